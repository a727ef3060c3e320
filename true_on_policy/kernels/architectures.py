"""The decoder architectures the consistent kernels cover, each described once, for both engines.

What differs between covered architectures is data, not code: which projections carry a bias,
whether queries and keys are RMS-normed, which RoPE scalings, whether the engines honour
``head_dim``, the MoE block, and the class names each engine builds. The kernels
(:mod:`.ops`) and the module code (:mod:`.model`, :mod:`true_on_policy.vllm_adapter.layers`) are
shared. Readers:

* transformers (:mod:`true_on_policy.transformers_adapter.patches`): the classes to patch,
  ``transformers.models.<model_type>.modeling_<model_type>.<prefix><Role>``;
* vLLM (:mod:`true_on_policy.vllm_adapter.patches`): the model classes it admits (named
  :attr:`Architecture.name`, as vLLM's registry names them) and the MoE block;
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

__all__ = [
    "Architecture",
    "Features",
    "Moe",
    "TABLE",
    "UncoveredModelError",
    "UnsupportedFeatureError",
    "by_name",
    "check_built",
    "read_checkpoint",
    "check_config",
    "config_dict",
    "names",
    "rope_parameters",
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
    """A sparse MoE block: router + experts in transformers, one fused block in vLLM."""

    transformers_router: str  # class in the architecture's transformers module
    transformers_experts: str
    vllm_block: str  # class in the architecture's vLLM module


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

    @property
    def transformers_module(self) -> str:
        return f"transformers.models.{self.model_type}.modeling_{self.model_type}"


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
)

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

    for key, feature in _UNCOVERED_KEYS:
        if config.get(key):
            refuse(feature)
    for key, feature in arch.refused:
        if config.get(key):
            refuse(feature)
    act = config.get("hidden_act", "silu")
    if act != "silu":
        refuse(f"activation {act!r} (only 'silu')")
    sliding = _sliding_layers(config)
    if sliding:
        refuse(f"sliding window attention (window {config.get('sliding_window')}, layers {sliding})")
    if config.get("is_causal") is False:
        refuse("non-causal attention (is_causal=false)")
    if config.get("attention_dropout"):
        refuse(f"attention dropout {config['attention_dropout']}")
    scale = config.get("logit_scale")
    if scale is not None and float(scale) != 1.0:
        refuse(f"logit scale {scale}")
    rope = rope_parameters(config)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in arch.rope_types:
        refuse(f"RoPE scaling {rope_type!r} (covered: {', '.join(arch.rope_types)})")
    if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) not in (None, 1.0):
        refuse(f"partial rotary factor {rope.get('partial_rotary_factor', config.get('partial_rotary_factor'))}")
    missing = [k for k in _ROPE_KEYS.get(rope_type, ()) if rope.get(k) is None]
    if missing:
        refuse(f"RoPE scaling {rope_type!r} without {missing}")
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
    )


_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

def check_built(features: Features, built: Mapping[str, bool], engine: str) -> None:
    """Refuse a model whose built modules (``built``: feature -> present, e.g. ``{"qkv_bias": True}``)
    differ from what its architecture's entry describes for its config."""
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
