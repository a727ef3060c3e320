"""The contract's vocabulary: canonical names both sides are written in, so they compare directly.

Values read from either engine's settings are canonical names, made so once by the launch reader
(:mod:`true_on_policy.config.vocabulary`, re-exported here for the section's pins); :data:`UNVERIFIED`
marks a side no setting determines, :data:`AUTO` one the engine picks at run time. Shared by the contract's rows, the kernel families and the CPU rollout.
"""

from __future__ import annotations

from true_on_policy.config.launch import ENV_PATH
from true_on_policy.config.vocabulary import AUTO, canonical_attention, canonical_dtype

__all__ = ["AUTO", "CPU_EP_KEY", "CPU_TP_KEY", "ENV", "NA", "TOP", "UNVERIFIED", "canonical_attention", "canonical_dtype"]

UNVERIFIED = "unverified"  # a side whose value no engine setting determines: never a mismatch, always flagged
NA = "n/a"
TOP = "true_on_policy"
ENV = ENV_PATH

# The CPU backend's training-side TP/EP (verl's FSDP engine has no slot for them); the names of its
# collectives are true_on_policy.kernels.scope's (torch-free).
CPU_TP_KEY = f"{TOP}.cpu_tensor_parallel_size"
CPU_EP_KEY = f"{TOP}.cpu_expert_parallel_size"

