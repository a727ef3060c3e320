"""Which implementation each side runs for GEMM, RMSNorm, log-softmax and attention.

Switches say "batch-invariant: on"; bitwise-equal log-probs need more: the *same* implementation
(same kernel, same tiling, same reduction order) on both sides. For every op this module names the
implementation each side runs, from the settings that select it, and how the two relate:

* ``ok``         - both sides run the same named implementation, each selected by a setting;
* ``mismatch``   - the implementations differ in kind (e.g. a batch-invariant kernel against one that
  is not): the values differ and the contract reports it;
* ``unverified`` - the implementation of a side is not pinned by any setting, or two separate
  implementations of the same algorithm are paired and their bitwise equality is not established
  (only a device run can establish it). The reason says which.

Pure: works on the typed views of the config (:mod:`true_on_policy.config.launch`).
Upstream files read for each name: docs/parallelism_and_determinism.md ("Kernel families").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from true_on_policy.contract.determinism_plan import MEGATRON_BI_MODE_UNDER_VERL, SOURCES
from true_on_policy.config.platforms import Platform, is_cpu_engine, is_vllm
from true_on_policy.config.launch import ENV_PATH, A, MEGATRON_TC, R, RolloutView, TrainingView
PROJECT = "true_on_policy.kernels (order-fixed consistent kernels)"

OPS = ("gemm", "norm", "log_softmax")
TITLES = {"gemm": "GEMM kernel", "norm": "RMSNorm kernel", "log_softmax": "log-softmax kernel"}


@dataclasses.dataclass(frozen=True)
class Family:
    impl: str  # the implementation that runs, e.g. "batch_invariant_ops.npu_mm_batch_invariant (AscendC)"
    source: str  # the setting (or upstream file) that selects it
    pinned: bool = True  # False: no setting decides it (the reason is in ``source``)


@dataclasses.dataclass(frozen=True)
class OpFamilies:
    op: str
    training: Family
    rollout: Family
    unverified: str = ""  # why equal names do not settle it, or why different names are not a proven mismatch


def _unpinned(why: str) -> Family:
    return Family("unpinned", why, pinned=False)


def families(
    training_view: TrainingView,
    rollout_view: RolloutView,
    *,
    platform: Platform,
    versions: Mapping[str, str | None],
    project: bool,
    project_rollout: bool,
) -> list[OpFamilies]:
    """GEMM / RMSNorm / log-softmax implementation per side. ``project`` / ``project_rollout``: the
    project's kernels run in training (unless Megatron) / in the rollout."""
    training = _training(training_view, platform, project)
    rollout = _rollout(rollout_view, platform, versions, project_rollout)
    return [_relate(op, training[op], rollout[op], platform) for op in OPS]


# Pairs of different names that are separate implementations of one algorithm: not a proven mismatch,
# not a proven match either.
_SAME_ALGORITHM = {
    frozenset({"megatron-core batch-invariant GEMM", "vLLM batch-invariant GEMM"}): (
        "Megatron-core's and vLLM's batch-invariant GEMMs are separate implementations (vLLM tunes tile "
        "configs per shape, megatron-core uses fixed ones / TE cuBLASLt): equality not established on device"
    ),
    frozenset({"TE RMSNorm", "vLLM batch-invariant RMSNorm (Triton)"}): (
        "per-row RMSNorm in both, but different kernels (TE vs vLLM Triton): equality not established on device"
    ),
}


def _relate(op: str, t: Family, r: Family, platform: Platform) -> OpFamilies:
    if not t.pinned or not r.pinned:
        side = "training" if not t.pinned else "rollout"
        return OpFamilies(op, t, r, f"{side} implementation not pinned: {(t if not t.pinned else r).source}")
    if t.impl == r.impl:
        if platform.device and t.impl == PROJECT:
            return OpFamilies(op, t, r, f"the same implementation on both sides ({t.impl}): written, not run on a device ({platform})")
        if platform.device:
            # Same name on a device stack this project has not run: say so rather than "ok".
            return OpFamilies(op, t, r, f"same implementation named on both sides ({t.impl}); not run on {platform} by this project")
        return OpFamilies(op, t, r)
    reason = _SAME_ALGORITHM.get(frozenset({t.impl, r.impl}), "")
    if not reason and op in ("log_softmax",) and platform.device:
        reason = (
            f"training {t.impl} vs rollout {r.impl}: two log-softmax implementations, both fp32; equality not "
            "established (no setting makes one side run the other's)"
        )
    return OpFamilies(op, t, r, reason)


def _training(t: TrainingView, platform: Platform, project: bool) -> dict[str, Family]:
    strategy, mg = t.strategy, t.megatron
    if project and mg is None:
        src = "true_on_policy.deterministic=true (project kernels patched into transformers)"
        return {op: Family(PROJECT, src) for op in OPS}
    log_softmax = Family(
        "verl log-prob kernel",
        f"{A}.strategy={strategy}: verl computes training log-probs itself "
        "(megatron: vocab-parallel log-softmax; fsdp: logprobs_from_logits)",
    )
    if mg is not None and platform.npu:
        bi_ops = mg.batch_invariant_ops or mg.batch_invariant_mode
        gemm = (
            Family("batch_invariant_ops.npu_mm_batch_invariant (AscendC)", f"{MEGATRON_TC}.use_batch_invariant_ops (MindSpeed)")
            if bi_ops
            else Family("torch_npu aclnn matmul (not batch-invariant)", f"{MEGATRON_TC}.use_batch_invariant_ops unset")
        )
        norm = _unpinned(
            "MindSpeed picks a fused npu_rms_norm or a torch RMSNorm (use_fused_rmsnorm); verl's config does not pin it"
        )
        return {"gemm": gemm, "norm": norm, "log_softmax": log_softmax}
    if mg is not None:
        bi = mg.batch_invariant_mode
        gemm = (
            _unpinned(f"{MEGATRON_TC}.batch_invariant_mode=true under verl: {MEGATRON_BI_MODE_UNDER_VERL}")
            if bi
            else Family("TE/cuBLAS GEMM (not batch-invariant)", f"{MEGATRON_TC}.batch_invariant_mode unset")
        )
        return {"gemm": gemm, "norm": Family("TE RMSNorm", f"{A}.megatron (TransformerEngine layer spec)"), "log_softmax": log_softmax}
    return {
        "gemm": Family("torch aten mm (vendor BLAS, not batch-invariant)", f"{A}.strategy={strategy} (HF model)"),
        "norm": Family("transformers RMSNorm (torch ops)", f"{A}.strategy={strategy} (HF model)"),
        "log_softmax": log_softmax,
    }


def _rollout(r: RolloutView, platform: Platform, versions: Mapping[str, str | None], project_rollout: bool) -> dict[str, Family]:
    name = r.name
    if project_rollout:
        via = "" if is_cpu_engine(name) else " through true_on_policy.vllm_adapter"
        return {op: Family(PROJECT, f"{R}.name={name} on {platform} (project kernels{via})") for op in OPS}
    if not is_vllm(name):
        return {op: _unpinned(f"{R}.name={name}: no kernel setting known to this project") for op in OPS}
    bi = r.vllm_batch_invariant
    if platform.npu:
        bi = bi or (r.vllm.rl_enabled and r.vllm.rl_batch_invariant)
        if not bi:
            off = Family("vllm-ascend default kernels (not batch-invariant)", f"{ENV_PATH}.VLLM_BATCH_INVARIANT unset")
            return {op: off for op in OPS}
        if versions.get("ops-batchinvariant"):
            gemm = Family(
                "batch_invariant_ops.npu_mm_batch_invariant (AscendC)",
                f"vllm_ascend/batch_invariant.py: AscendC ops when batch_invariant_ops is importable "
                f"(ops-batchinvariant {versions.get('ops-batchinvariant')})",
            )
        else:
            gemm = _unpinned(
                "vllm-ascend uses the AscendC batch_invariant_ops matmul when that package is importable, else its "
                "Triton matmul; ops-batchinvariant is neither installed here nor declared in true_on_policy.stack_versions"
            )
        return {
            "gemm": gemm,
            "norm": Family("torch_npu.npu_rms_norm", "vllm_ascend/batch_invariant.py (add_rms_norm: add, then npu_rms_norm)"),
            "log_softmax": Family("vLLM sampler log_softmax (torch, fp32)", "vllm/v1/sample/sampler.py (compute_logprobs)"),
        }
    if not bi:
        off = Family("vLLM default kernels (not batch-invariant)", f"{ENV_PATH}.VLLM_BATCH_INVARIANT unset")
        return {op: off for op in OPS}
    src = f"{ENV_PATH}.VLLM_BATCH_INVARIANT=1 ({SOURCES['vllm_bi']} / {SOURCES['vllm_bi_029']})"
    return {
        "gemm": Family("vLLM batch-invariant GEMM", src),
        "norm": Family("vLLM batch-invariant RMSNorm (Triton)", src),
        "log_softmax": Family("vLLM batch-invariant log_softmax (Triton)", src),
    }
