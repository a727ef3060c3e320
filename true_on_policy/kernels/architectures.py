"""The decoder architectures the consistent kernels cover, each described once, for both engines.

What differs between covered architectures is data, not code: which projections carry a bias,
whether queries and keys are RMS-normed, which RoPE scalings, whether the engines honour
``head_dim``, the MoE block, and the class names each engine builds. The kernels
(:mod:`.ops`) and the module code (:mod:`true_on_policy.transformers_adapter.forwards`, the modules of :mod:`true_on_policy.vllm_adapter`) are
shared. Readers:

* transformers (:mod:`true_on_policy.transformers_adapter.patches`): the classes to patch,
  ``transformers.models.<dir>.modeling_<dir>.<prefix><Role>`` (``dir``: the model_type unless the entry names it);
* vLLM (:mod:`true_on_policy.vllm_adapter.patches`, :mod:`true_on_policy.vllm_adapter.targets`): the model
  classes it admits (named :attr:`Architecture.name`, as vLLM's registry names them) and the classes whose
  methods it replaces (MoE block, gated attention, Gated DeltaNet layer);
* both, before a model is built: :func:`check_config` refuses, naming the architecture and the
  feature, what is not covered; after it is built, each engine compares its modules with
  the :class:`Features` :func:`check_config` returns
  (biases, q/k norm, tied head).

Pure: no torch, transformers or vLLM import. To add an architecture, see README ("Adding an
architecture"): an :class:`Architecture` entry in :data:`TABLE`, a tiny model in
``tiny_assets`` and its rows in the bitwise tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from true_on_policy.kernels.scope import MAX_TP

__all__ = [
    "Architecture",
    "BUILT_FEATURES",
    "Checkpoint",
    "Features",
    "LinearAttention",
    "Moe",
    "TABLE",
    "UncoveredModelError",
    "UnsupportedFeatureError",
    "by_name",
    "check_built",
    "read_checkpoint",
    "check_config",
    "check_sequence_parallel",
    "check_sharding",
    "config_dict",
    "inspect_checkpoint",
    "layer_types",
    "names",
    "rope_parameters",
    "rotary_dim",
]


class UnsupportedFeatureError(NotImplementedError):
    """A model feature the consistent path does not cover, met while the flag is on."""


class UncoveredModelError(UnsupportedFeatureError, ValueError):
    """A model config names an architecture or feature the consistent path does not cover.

    A ValueError too: a bad config, refused before anything starts (the launch exits 2 on it).
    """


Bias = bool | str  # always / never, or the config key (read as a bool) that switches it


@dataclass(frozen=True)
class Moe:
    """A sparse MoE block: router + experts in transformers, one fused block in vLLM.

    ``shared_expert``: transformers' block class (Qwen3.5-MoE: routed + a sigmoid-gated shared expert), whose
    forward is replaced; None: no shared expert. ``always_renormalize``: the router renormalizes its top-k
    weights with no switch (Qwen3.5-MoE), else it reads ``norm_topk_prob``.
    """

    transformers_router: str  # class in the architecture's transformers module
    transformers_experts: str
    vllm_block: str  # class in the architecture's vLLM module (imported there from vllm_block_module)
    shared_expert: str | None = None
    always_renormalize: bool = False
    vllm_block_module: str | None = None  # where vLLM defines the block, where not the architecture's module


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet layers (``layer_types`` entries ``linear_attention``): the transformers classes patched.

    ``layer``: its forward becomes :func:`true_on_policy.kernels.gated_delta.gated_delta_net_varlen` between
    consistent linears; ``norm``: the gated RMSNorm; ``text_model``: its forward hands the layers the
    packed sequences' boundaries (from the position ids, which transformers does not pass to the layer).
    """

    layer: str
    norm: str
    text_model: str
    # vLLM's layer (one class for every Gated DeltaNet model), its module
    vllm_layer: str = "QwenGatedDeltaNetAttention"
    vllm_layer_module: str = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"


@dataclass(frozen=True)
class Architecture:
    """One covered architecture: what its two engines build, and what is refused.

    ``refused`` lists ``(config key, feature)`` pairs covered only while the key is absent,
    null or false in the config (e.g. a switch one engine reads and the other ignores).
    """

    name: str  # config.json "architectures"[0]; vLLM's model class of the same name
    model_type: str  # config.json "model_type"
    transformers_prefix: str  # Qwen2 -> Qwen2RMSNorm, Qwen2Attention, ..., Qwen2ForCausalLM
    vllm_module: str
    qkv_bias: Bias = False
    o_bias: Bias = False
    mlp_bias: Bias = False
    qk_norm: bool = False
    rope_types: tuple[str, ...] = ("default", "linear")
    honours_head_dim: bool = True  # False: vLLM derives head_dim = hidden_size // num_attention_heads
    moe: Moe | None = None
    refused: tuple[tuple[str, str], ...] = ()
    refused_values: tuple[tuple[str, Any, str], ...] = ()  # (config key, value, feature): refused at that value
    transformers_dir: str | None = None  # the modeling module's directory, where it is not the model_type
    unit_offset_norm: bool = False  # RMSNorm multiplies by (1 + weight) in fp32 before the cast (Qwen3.5)
    gated_attention: bool = False  # q_proj also yields a per-head gate: output * sigmoid(gate) (Qwen3.5)
    vllm_attention: str | None = None  # vLLM's gated attention class (forward replaced), in vllm_attention_module
    vllm_attention_module: str | None = None
    partial_rotary: bool = False  # partial_rotary_factor < 1 (only the first features of a head rotate)
    layer_types: tuple[str, ...] = ("full_attention",)  # the config's layer_types entries covered
    linear_attention: LinearAttention | None = None
    rotary_class: str = "RotaryEmbedding"  # the rotary embedding's class, after the prefix
    # rope_parameters.mrope_section (a multimodal checkpoint's text config) read as 1-D RoPE by both engines:
    # vLLM drops the mRoPE keys of these text models, transformers' three position rows are equal for text.
    # Elsewhere vLLM builds MRotaryEmbedding (3 position rows), refused by name.
    text_mrope: bool = False

    @property
    def transformers_module(self) -> str:
        directory = self.transformers_dir or self.model_type
        return f"transformers.models.{directory}.modeling_{directory}"


# What Qwen3.5's text models (dense and MoE) share: 3 Gated DeltaNet layers to 1 gated full-attention layer
_QWEN35_REFUSED = (
    ("attention_bias", "attention_bias=true (transformers biases q/k/v/o_proj, vLLM reads qkv_bias)"),
    ("qkv_bias", "qkv_bias (vLLM reads it, transformers' Qwen3.5 does not)"),
    ("layer_scale", "layer_scale (vLLM reads it, transformers' Qwen3.5 does not)"),
)
_QWEN35_REFUSED_VALUES = (
    ("attn_output_gate", False, "attn_output_gate=false (transformers' Qwen3.5 attention is always gated)"),
)
_QWEN3_NEXT = "vllm.model_executor.models.qwen3_next"  # where vLLM's Qwen3.5 model takes its attention and MoE from
_QWEN35 = dict(qk_norm=True, rope_types=("default",), unit_offset_norm=True, gated_attention=True, partial_rotary=True,
               vllm_attention="Qwen3NextAttention", vllm_attention_module=_QWEN3_NEXT,
               layer_types=("linear_attention", "full_attention"), rotary_class="TextRotaryEmbedding", text_mrope=True)

TABLE: tuple[Architecture, ...] = (
    Architecture(
        name="Qwen3ForCausalLM",
        model_type="qwen3",
        transformers_prefix="Qwen3",
        vllm_module="vllm.model_executor.models.qwen3",
        qk_norm=True,
        refused=(("attention_bias", "attention_bias=true (transformers biases o_proj, vLLM's Qwen3 does not)"),),
    ),
    Architecture(
        name="Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        transformers_prefix="Qwen3Moe",
        vllm_module="vllm.model_executor.models.qwen3_moe",
        qk_norm=True,
        moe=Moe("Qwen3MoeTopKRouter", "Qwen3MoeExperts", "Qwen3MoeSparseMoeBlock"),
        refused=(("attention_bias", "attention_bias=true (transformers biases o_proj, vLLM's Qwen3-MoE does not)"),),
    ),
    Architecture(  # Qwen2 and Qwen2.5 (R1-Distill-Qwen, Qwen2.5-Math)
        name="Qwen2ForCausalLM",
        model_type="qwen2",
        transformers_prefix="Qwen2",
        vllm_module="vllm.model_executor.models.qwen2",
        qkv_bias=True,
        honours_head_dim=False,
        refused=(
            ("qk_norm", "q/k norm (vLLM's Qwen2 option; transformers' Qwen2 has none)"),
            ("dual_chunk_attention_config", "dual-chunk attention"),
        ),
    ),
    Architecture(  # Llama 2 / 3 / 3.1+ (Llama-3 RoPE scaling)
        name="LlamaForCausalLM",
        model_type="llama",
        transformers_prefix="Llama",
        vllm_module="vllm.model_executor.models.llama",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias="mlp_bias",
        rope_types=("default", "linear", "llama3"),
        refused=(
            ("qkv_bias", "qkv_bias (vLLM reads it, transformers' Llama does not)"),
            ("bias", "bias (vLLM reads it, transformers' Llama does not)"),
        ),
    ),
    Architecture(  # Qwen3.5 dense text model (Qwen3_5ForConditionalGeneration's text_config)
        name="Qwen3_5ForCausalLM",
        model_type="qwen3_5_text",
        transformers_prefix="Qwen3_5",
        transformers_dir="qwen3_5",
        vllm_module="vllm.model_executor.models.qwen3_5",
        linear_attention=LinearAttention("Qwen3_5GatedDeltaNet", "Qwen3_5RMSNormGated", "Qwen3_5TextModel"),
        refused=_QWEN35_REFUSED,
        refused_values=_QWEN35_REFUSED_VALUES,
        **_QWEN35,
    ),
    Architecture(  # Qwen3.5 / 3.6 MoE text model (Qwen3.5-35B-A3B's text_config)
        name="Qwen3_5MoeForCausalLM",
        model_type="qwen3_5_moe_text",
        transformers_prefix="Qwen3_5Moe",
        transformers_dir="qwen3_5_moe",
        vllm_module="vllm.model_executor.models.qwen3_5",
        moe=Moe("Qwen3_5MoeTopKRouter", "Qwen3_5MoeExperts", "Qwen3NextSparseMoeBlock",
                shared_expert="Qwen3_5MoeSparseMoeBlock", always_renormalize=True, vllm_block_module=_QWEN3_NEXT),
        linear_attention=LinearAttention("Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeRMSNormGated", "Qwen3_5MoeTextModel"),
        refused=_QWEN35_REFUSED + (("mlp_only_layers", "mlp_only_layers (vLLM reads it, transformers' Qwen3.5-MoE "
                                                       "has MoE in every layer)"),),
        refused_values=_QWEN35_REFUSED_VALUES + (
            ("norm_topk_prob", False, "norm_topk_prob=false (transformers' Qwen3.5-MoE router always renormalizes)"),
        ),
        **_QWEN35,
    ),
)

# Vision-language checkpoints whose text model is covered: refused by name, pointing at the text model.
_TEXT_MODEL_OF = {
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
}

_BY_NAME = {arch.name: arch for arch in TABLE}
_BY_MODEL_TYPE = {arch.model_type: arch for arch in TABLE}


def names() -> tuple[str, ...]:
    return tuple(_BY_NAME)


def by_name(name: str) -> Architecture | None:
    return _BY_NAME.get(name)


@dataclass(frozen=True)
class Features:
    """One model's covered features, as both engines must build them."""

    architecture: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tied_embeddings: bool
    rope_type: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe: bool
    layer_types: tuple[str, ...] = ("full_attention",)
    rotary_dim: int = 0  # the rotated features of a head (head_dim unless partial)
    # Gated DeltaNet: (key heads, value heads, key head dim, value head dim, conv taps); None: no such layers
    linear_attention: tuple[int, int, int, int, int] | None = None
    shared_expert: bool = False


# Config keys of features no covered architecture has; a non-empty value is refused by name.
_UNCOVERED_KEYS = (
    ("quantization_config", "quantized weights (quantization_config)"),
    ("final_logit_softcapping", "soft-capped logits (final_logit_softcapping)"),
    ("attn_logit_softcapping", "soft-capped attention logits (attn_logit_softcapping)"),
    ("kv_lora_rank", "multi-head latent attention (MLA, kv_lora_rank)"),
    ("q_lora_rank", "multi-head latent attention (MLA, q_lora_rank)"),
    ("shared_expert_intermediate_size", "shared experts (shared_expert_intermediate_size)"),
    ("n_shared_experts", "shared experts (n_shared_experts)"),
    ("num_shared_experts", "shared experts (num_shared_experts)"),
)


def config_dict(config: Any) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        raise TypeError(f"architectures: a model config must be a mapping or have to_dict(), got {type(config).__name__}")
    return to_dict()


def rope_parameters(config: Mapping) -> dict:
    """The RoPE parameters of a config dict, old (``rope_scaling`` + ``rope_theta``) or new style."""
    params = config.get("rope_parameters")
    if params:
        return dict(params)
    scaling = dict(config.get("rope_scaling") or {})
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    scaling.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return scaling


def _sliding_layers(config: Mapping) -> list[int]:
    """Layers with sliding-window attention, as transformers lays them out."""
    types = config.get("layer_types")
    if types is not None:
        return [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    if config.get("sliding_window") is None or config.get("use_sliding_window") is False:
        return []
    first = config.get("max_window_layers") or 0
    return [i for i in range(int(config.get("num_hidden_layers") or 0)) if i >= first]


def _flag(config: Mapping, bias: Bias) -> bool:
    return bool(config.get(bias)) if isinstance(bias, str) else bias


def _architecture(config: Mapping) -> Architecture:
    listed = config.get("architectures") or []
    model_type = config.get("model_type")
    vision = [(name, text) for name, (vl_type, text) in _TEXT_MODEL_OF.items()
              if (listed and listed[0] == name) or (not listed and model_type == vl_type)]
    if vision:
        name, text = vision[0]
        covered = by_name(text)
        raise UncoveredModelError(
            f"true_on_policy: {name} (a vision-language checkpoint, model_type {_TEXT_MODEL_OF[name][0]!r}) is not "
            f"covered; pass its text model: a checkpoint whose config.json is its text_config, with architectures "
            f"[{text!r}] and model_type {covered.model_type!r}"
        )
    arch = by_name(listed[0]) if listed else _BY_MODEL_TYPE.get(model_type)
    if arch is None:
        named = listed[0] if listed else f"model_type {model_type!r}"
        raise UncoveredModelError(
            f"true_on_policy: architecture {named} is not covered by the consistent kernels "
            f"(covered: {', '.join(names())}); see README, 'Adding an architecture'"
        )
    if model_type is not None and model_type != arch.model_type:
        raise UncoveredModelError(
            f"true_on_policy: {arch.name}: model_type {model_type!r} is not covered (expected {arch.model_type!r})"
        )
    return arch


def expert_count(config: dict) -> tuple[str, int]:
    """The config key that holds the model's expert count, and the count (0: no experts).
    transformers 5 writes Qwen3-MoE's as ``num_local_experts``; ``num_experts`` is its alias."""
    key = "num_experts" if config.get("num_experts") else "num_local_experts"
    return key, int(config.get(key) or 0)


def check_config(config: Any) -> Features:
    """The covered features of a model config (a dict, e.g. config.json, or a transformers config).

    Raises :class:`UncoveredModelError` naming the architecture and the first feature the
    consistent path does not cover: another architecture, sliding-window attention, soft-capped
    logits, MLA, shared experts, a RoPE scaling or activation it does not implement, ...
    """
    config = config_dict(config)
    arch = _architecture(config)

    def refuse(feature: str):
        raise UncoveredModelError(
            f"true_on_policy: {arch.name}: {feature} is not covered by the consistent kernels (deterministic=true)"
        )

    shared = arch.moe is not None and arch.moe.shared_expert is not None
    for key, feature in _UNCOVERED_KEYS:
        if config.get(key) and not (shared and key == "shared_expert_intermediate_size"):
            refuse(feature)
    for key, feature in arch.refused:
        if config.get(key):
            refuse(feature)
    for key, value, feature in arch.refused_values:
        if key in config and config[key] == value:
            refuse(feature)
    act = config.get("hidden_act", "silu")
    if act != "silu":
        refuse(f"activation {act!r} (only 'silu')")
    if config.get("is_causal") is False:
        refuse("non-causal attention (is_causal=false)")
    if config.get("attention_dropout"):
        refuse(f"attention dropout {config['attention_dropout']}")
    scale = config.get("logit_scale")
    if scale is not None and float(scale) != 1.0:
        refuse(f"logit scale {scale}")
    layer_types = _layer_types(config, arch, refuse)
    rope_type, rotated = _check_rope(config, arch, refuse)
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    derived = int(config["hidden_size"]) // heads
    head_dim = int(config.get("head_dim") or derived) if arch.honours_head_dim else derived
    if not arch.honours_head_dim and config.get("head_dim") not in (None, derived):
        refuse(f"head_dim={config['head_dim']} other than hidden_size/num_attention_heads={derived} "
               f"(vLLM's {arch.name} derives it)")
    if heads % kv_heads:
        refuse(f"{heads} query heads over {kv_heads} key/value heads")
    experts_key, num_experts = expert_count(config)
    if arch.moe is None and num_experts:
        refuse(f"{experts_key}={num_experts} on a dense architecture")
    return Features(
        architecture=arch.name,
        qkv_bias=_flag(config, arch.qkv_bias),
        o_bias=_flag(config, arch.o_bias),
        mlp_bias=_flag(config, arch.mlp_bias),
        qk_norm=arch.qk_norm,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_type=rope_type,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        moe=arch.moe is not None,
        layer_types=layer_types,
        rotary_dim=rotated,
        linear_attention=_linear_attention_dims(config, refuse) if "linear_attention" in layer_types else None,
        shared_expert=shared,
    )


def layer_types(config: Any) -> tuple[str, ...]:
    """Each layer's type as :func:`check_config` derives it for :class:`Features` (a config that omits
    ``layer_types`` included), refusing nothing: what the contract reads. An architecture the table does
    not know: the config's ``layer_types`` as written."""
    config = config_dict(config)
    try:
        arch = _architecture(config)
    except UncoveredModelError:
        return tuple(config.get("layer_types") or ())
    return _layer_types(config, arch, refuse=lambda feature: None)


def _layer_types(config: Mapping, arch: Architecture, refuse) -> tuple[str, ...]:
    """Each layer's type, as transformers builds them (Qwen3.5 without ``layer_types``: every
    ``full_attention_interval``-th layer full, the others linear); a type the entry does not cover is refused."""
    sliding = _sliding_layers(config)
    if sliding:
        refuse(f"sliding window attention (window {config.get('sliding_window')}, layers {sliding})")
    count = int(config.get("num_hidden_layers") or 0)
    types = config.get("layer_types")
    if types is None and arch.linear_attention is not None:
        interval = int(config.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(count)]
    types = tuple(types) if types is not None else ("full_attention",) * count
    other = sorted({kind for kind in types if kind not in arch.layer_types})
    if other:
        refuse(f"layer types {other} (covered: {', '.join(arch.layer_types)})")
    return types


def _check_rope(config: Mapping, arch: Architecture, refuse) -> tuple[str, int]:
    """The RoPE type and the rotated features of a head (:func:`rotary_dim`), each checked."""
    rope = rope_parameters(config)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in arch.rope_types:
        refuse(f"RoPE scaling {rope_type!r} (covered: {', '.join(arch.rope_types)})")
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    top = config.get("partial_rotary_factor")
    if top is not None and factor is not None and float(top) != float(factor):
        # transformers reads rope_parameters' factor; vLLM's config loading lets the top-level key win
        refuse(f"partial_rotary_factor={top} differs from rope_parameters.partial_rotary_factor={factor} "
               "(transformers rotates by the latter, vLLM by the former)")
    if factor not in (None, 1.0) and not arch.partial_rotary:
        refuse(f"partial rotary factor {factor}")
    missing = [k for k in _ROPE_KEYS.get(rope_type, ()) if rope.get(k) is None]
    if missing:
        refuse(f"RoPE scaling {rope_type!r} without {missing}")
    if "mrope_section" in rope and not arch.text_mrope:  # vLLM reads the key's presence
        refuse(f"multimodal RoPE (MRotaryEmbedding, rope_parameters.mrope_section={rope['mrope_section']}; "
               "1-D for text on Qwen3.5's text models only)")
    try:
        return rope_type, rotary_dim(config)
    except ValueError as error:
        refuse(str(error))


def rotary_dim(config: Mapping) -> int:
    """The rotated features of a head: ``int(head_dim * partial_rotary_factor)`` (the factor from the RoPE
    parameters or the config, default 1.0), as transformers computes it; ValueError unless even and in
    (0, head_dim]."""
    config = config_dict(config)
    factor = rope_parameters(config).get("partial_rotary_factor", config.get("partial_rotary_factor"))
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    dim = int(head_dim * (1.0 if factor is None else float(factor)))
    if dim <= 0 or dim % 2 or dim > head_dim:
        raise ValueError(f"partial_rotary_factor={factor} gives {dim} rotated features of head_dim {head_dim} "
                         "(an even number in (0, head_dim] is needed)")
    return dim


_LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim")


def _linear_attention_dims(config: Mapping, refuse) -> tuple[int, int, int, int, int]:
    """The Gated DeltaNet dims (:data:`_LINEAR_KEYS`), each present and positive, value heads a multiple of key heads."""
    missing = [key for key in _LINEAR_KEYS if not config.get(key)]
    if missing:
        refuse(f"linear attention layers without {missing}")
    dims = tuple(int(config[key]) for key in _LINEAR_KEYS)
    if dims[1] % dims[0]:
        refuse(f"{dims[1]} Gated DeltaNet value heads over {dims[0]} key heads")
    return dims


_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

# What each engine reports of the model it built (``mlp_bias`` only where a dense MLP exists): both engines
# compare the same features with the table's.
BUILT_FEATURES = ("qkv_bias", "o_bias", "qk_norm", "rotary_dim", "mlp_bias", "linear_attention", "shared_expert")


def check_built(features: Features, built: Mapping[str, Any], engine: str) -> None:
    """Refuse a model whose built modules (``built``: feature -> what was built, e.g. ``{"qkv_bias": True}``,
    every key of :data:`BUILT_FEATURES`) differ from what its architecture's entry describes for its config."""
    reported = set(built) | {"mlp_bias"}
    if set(built) - set(BUILT_FEATURES) or reported != set(BUILT_FEATURES):
        raise AssertionError(f"{engine}'s built features {sorted(built)} are not {list(BUILT_FEATURES)}")
    wrong = [f"{key}: built {value}, described {getattr(features, key)}" for key, value in built.items()
             if value != getattr(features, key)]
    if wrong:
        raise UnsupportedFeatureError(
            f"true_on_policy: {features.architecture} as {engine} built it differs from its entry in "
            f"true_on_policy/kernels/architectures.py: {'; '.join(wrong)}"
        )


def read_checkpoint(path: str | os.PathLike) -> dict | None:
    """The parsed ``path/config.json``, read once by whoever checks it (:func:`check_config`, the
    sharding check); None if ``path`` is not a local checkpoint directory (a hub name: the engines
    check the config when they load it)."""
    config_file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(config_file):
        return None
    with open(config_file) as handle:
        return json.load(handle)


@dataclass(frozen=True)
class Checkpoint:
    """A local checkpoint's config.json, read and judged once (by :func:`inspect_checkpoint`): what the
    verdict and the contract read of it."""

    config: dict
    layer_types: tuple[str, ...]  # as :func:`layer_types` derives them (a config without ``layer_types`` too)
    features: Features | None  # None: not covered (``uncovered`` says why)
    uncovered: str = ""  # check_config's refusal, naming the architecture and the feature


def inspect_checkpoint(path: str | os.PathLike) -> Checkpoint | None:
    """``path``'s config.json with its layer types and :func:`check_config`'s answer; None if ``path``
    is not a local checkpoint directory. Nothing is refused here: the verdict refuses ``uncovered`` when
    the project's kernels run."""
    config = read_checkpoint(path)
    if config is None:
        return None
    try:
        features, uncovered = check_config(config), ""
    except UnsupportedFeatureError as error:
        features, uncovered = None, str(error)
    except (KeyError, TypeError, ValueError) as error:  # a config.json no engine could build a model from
        features, uncovered = None, f"true_on_policy: its config.json is not a model config ({type(error).__name__}: {error})"
    return Checkpoint(config, layer_types(config), features, uncovered)


def check_sharding(config, tp_size: int, ep_size: int = 1) -> None:
    """Refuse, naming the key and value, a TP / EP size the consistent kernels do not keep bitwise.

    TP and EP must be powers of two <= :data:`MAX_TP` (the reduction tree's leaves hold whole
    subtrees only up to it); the query and KV head counts, the Gated DeltaNet's key and value head counts,
    the MLP's intermediate size and, with experts split by TP (EP 1), the experts' intermediate size must
    divide by TP; the experts by EP.
    ``config`` is the model's config (a dict such as config.json, or a transformers config). Checked
    before a model is sharded or an engine starts, and by the contract's ``sharding`` row (torch-free).
    """
    config = config_dict(config)
    for name, size in (("tensor_parallel_size", tp_size), ("expert_parallel_size", ep_size)):
        if not isinstance(size, int) or size < 1 or size & (size - 1) or size > MAX_TP:
            raise ValueError(
                f"true_on_policy: {name}={size!r} is not supported: the consistent kernels keep their bits at "
                f"powers of two up to MAX_TP={MAX_TP} (true_on_policy.kernels.ops)"
            )
    experts_key, num_experts = expert_count(config)
    divisible = [("num_attention_heads", tp_size), ("num_key_value_heads", tp_size), ("intermediate_size", tp_size),
                 ("linear_num_key_heads", tp_size), ("linear_num_value_heads", tp_size)]  # Gated DeltaNet heads
    if num_experts and ep_size == 1:
        divisible.append(("moe_intermediate_size", tp_size))
    if ep_size > 1:
        if not num_experts:
            raise ValueError(f"true_on_policy: expert_parallel_size={ep_size} for a model without experts")
        divisible.append((experts_key, ep_size))
    for key, size in divisible:
        value = config.get(key)
        if value is not None and value % size:
            what = "expert_parallel_size" if key == experts_key else "tensor_parallel_size"
            raise ValueError(f"true_on_policy: the model's {key}={value} does not divide by {what}={size}")


def check_sequence_parallel(config, sp_size: int) -> None:
    """Refuse, naming the key and value, a Ulysses SP size the model's heads do not split by.

    The all-to-all hands each rank whole heads (:mod:`true_on_policy.kernels.sequence_parallel`): the
    query heads and the Gated DeltaNet's key and value heads must divide by SP; the KV heads divide by it
    or divide it (then repeated to split, verl's rule). Run by ``check`` and the launch (the Ulysses row);
    the model code refuses the same by name when its all-to-all runs.
    """
    config = config_dict(config)
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise ValueError(f"true_on_policy: ulysses_sequence_parallel_size={sp_size!r} is not a positive integer")
    for key in ("num_attention_heads", "linear_num_key_heads", "linear_num_value_heads"):
        value = config.get(key)
        if value is not None and value % sp_size:
            raise ValueError(f"true_on_policy: the model's {key}={value} does not divide by "
                             f"ulysses_sequence_parallel_size={sp_size}")
    kv = config.get("num_key_value_heads")
    if kv and kv % sp_size and sp_size % kv:
        raise ValueError(f"true_on_policy: the model's num_key_value_heads={kv} and ulysses_sequence_parallel_size="
                         f"{sp_size} do not divide either way")
