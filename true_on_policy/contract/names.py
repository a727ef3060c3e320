"""The contract's vocabulary: canonical names both sides are written in, so they compare directly.

Values read from either engine's settings are canonical names, made so once by the launch reader
(:mod:`true_on_policy.config.vocabulary`, re-exported here for the section's pins); :data:`UNVERIFIED`
marks a side no setting determines, :data:`AUTO` one the engine picks at run time. Shared by the contract's rows, the kernel families and the CPU rollout.
"""

from __future__ import annotations

from collections.abc import Mapping

from true_on_policy.config.launch import ENV_PATH, parse_bool
from true_on_policy.config.vocabulary import AUTO, canonical_attention, canonical_dtype

__all__ = ["AUTO", "CPU_EP_KEY", "CPU_TP_KEY", "ENV", "NA", "TOP", "UNVERIFIED", "canonical_attention", "canonical_dtype",
           "vllm_batch_invariant"]

UNVERIFIED = "unverified"  # a side whose value no engine setting determines: never a mismatch, always flagged
NA = "n/a"
TOP = "true_on_policy"
ENV = ENV_PATH

# The CPU backend's training-side TP/EP (verl's FSDP engine has no slot for them); the names of its
# collectives are true_on_policy.kernels.scope's (torch-free).
CPU_TP_KEY = f"{TOP}.cpu_tensor_parallel_size"
CPU_EP_KEY = f"{TOP}.cpu_expert_parallel_size"


def vllm_batch_invariant(env: Mapping[str, str]) -> bool:
    """``VLLM_BATCH_INVARIANT`` in the workers' environment (vLLM's and vllm-ascend's switch)."""
    return parse_bool(f"{ENV}.VLLM_BATCH_INVARIANT", env.get("VLLM_BATCH_INVARIANT"))
