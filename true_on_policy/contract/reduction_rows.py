"""The rows of how each side reduces across ranks: the row-parallel reduction and MoE dispatch, combine
and router dtype.
"""

from __future__ import annotations


from true_on_policy.config.launch import (
    ROW_PARALLEL_ALL_REDUCE,
    ROW_PARALLEL_NONE,
    ROW_PARALLEL_RS_AG,
    A,
    MEGATRON,
    MEGATRON_TC,
    R,
    RolloutView,
)
from true_on_policy.config.platforms import Platform, is_cpu_engine, is_vllm
from true_on_policy.contract.determinism_plan import SOURCES
from true_on_policy.contract.names import (
    CPU_TP_KEY,
    ENV,
    TOP,
    UNVERIFIED,
    canonical_dtype,
)
from true_on_policy.contract.rows import (
    Side,
    Row,
    Context,
    as_size,
)
from true_on_policy.kernels.scope import MOE_DISPATCH, ROW_PARALLEL_REDUCTION

# --------------------------------------------------------------------------------------------
# row-parallel reduction and MoE
# --------------------------------------------------------------------------------------------


def _rollout_row_parallel(r: RolloutView, platform: Platform) -> Side:
    tp = r.tp
    if tp <= 1:
        return Side(ROW_PARALLEL_NONE, f"{R}.tensor_model_parallel_size=1")
    if is_cpu_engine(r.name):
        return Side(ROW_PARALLEL_REDUCTION, f"{R}.name=cpu, {R}.tensor_model_parallel_size={tp} (true_on_policy.kernels.tensor_parallel)")
    if r.vllm is not None and platform.npu:
        key = f"{R}.engine_kwargs.vllm.additional_config.enable_flashcomm1"
        src = f"{ENV}.VLLM_ASCEND_ENABLE_FLASHCOMM1 / {key}"
        return Side(ROW_PARALLEL_RS_AG if r.flashcomm1 else ROW_PARALLEL_ALL_REDUCE, src)
    if r.vllm is not None:
        src = f"{R}.engine_kwargs.vllm.compilation_config.pass_config.enable_sp"
        return Side(ROW_PARALLEL_RS_AG if r.vllm.sequence_parallel else ROW_PARALLEL_ALL_REDUCE, src)
    return Side(ROW_PARALLEL_ALL_REDUCE, f"{R}.name={r.name} (tensor-parallel all-reduce)")


def row_parallel_row(c: Context) -> Row:
    t_rp = Side(c.t.row_parallel, f"{A}.megatron.sequence_parallel (TP>1: true = reduce-scatter + all-gather)")
    if c.platform.cpu_backend and c.t.megatron is None and c.t.torchtitan is None and as_size(c.tl.tp.value) > 1:
        t_rp = Side(ROW_PARALLEL_REDUCTION, f"{CPU_TP_KEY}={c.tl.tp.value} (true_on_policy.kernels.tensor_parallel)")
    r_rp = _rollout_row_parallel(c.r, c.platform)
    pin = c.settings.row_parallel_reduction
    return Row(
        "row_parallel",
        "row-parallel reduction",
        t_rp,
        r_rp,
        required=pin if pin and as_size(c.tl.tp.value) > 1 else None,
        required_source=f"{TOP}.row_parallel_reduction",
        fix=(
            f"match {A}.megatron.sequence_parallel with the rollout: Ascend release builds "
            f"{ENV}.VLLM_ASCEND_ENABLE_FLASHCOMM1=1 (FlashComm1 = reduce-scatter + all-gather; gone from main); "
            f"CUDA keep TP=1 or sequence_parallel=false (vLLM's SP pass is not batch invariant); CPU: set "
            f"{CPU_TP_KEY} equal to {R}.tensor_model_parallel_size"
        ),
    )


_VLLM_ALLGATHER_BACKENDS = {"naive", "allgather_reducescatter"}


def _training_dispatcher(c: Context, ep: int) -> Side:
    t, pin = c.t, c.settings.moe_dispatcher
    if c.project and c.deterministic and t.megatron is None:
        return Side(pin or ("local" if ep <= 1 else MOE_DISPATCH), f"{TOP}.moe_dispatcher (project kernels)")
    if t.megatron is not None:
        key = f"{MEGATRON_TC}.moe_token_dispatcher_type"
        value = t.megatron.dispatcher
        if ep <= 1:
            return Side("local", f"{MEGATRON}.expert_model_parallel_size=1")
        return Side(str(value or "alltoall"), key + ("" if value else " (verl default alltoall)"))
    if ep <= 1:
        return Side("local", f"{A}.strategy={t.strategy} (experts on every rank)")
    return Side(UNVERIFIED, f"{A}.strategy={t.strategy} (no dispatcher key)")


def _rollout_dispatcher(c: Context, ep: int) -> Side:
    r, settings = c.r, c.settings
    if c.project_rollout:
        return Side(settings.moe_dispatcher or ("local" if ep <= 1 else MOE_DISPATCH), f"{TOP}.moe_dispatcher (project kernels)")
    if ep <= 1:
        return Side("local", f"{R}.expert_parallel_size<=1 (experts TP-split, no dispatch)")
    if r.vllm is not None and settings.platform.npu:
        return Side(UNVERIFIED, "vllm-ascend selects its MoE communication per batch (no setting)")
    if r.vllm is not None:
        key = f"{R}.engine_kwargs.vllm.all2all_backend"
        backend = r.vllm.all2all_backend or "allgather_reducescatter"
        family = "allgather" if backend in _VLLM_ALLGATHER_BACKENDS else "alltoall"
        return Side(family, key + ("" if r.vllm.all2all_backend else " (vLLM default allgather_reducescatter)"), f"{family} ({backend})")
    return Side(UNVERIFIED, f"{R}.name={r.name} (no dispatcher key)")


def _training_router_dtype(c: Context, compute: str) -> Side:
    t, pin = c.t, c.settings.moe_router_dtype
    if c.project and c.deterministic and t.megatron is None:
        return Side(canonical_dtype(pin) if pin else compute, f"{TOP}.moe_router_dtype (project kernels)")
    if t.megatron is not None:
        key = f"{MEGATRON_TC}.moe_router_dtype"
        value = t.megatron.router_dtype
        return Side(value or compute, key + ("" if value else " (unset: compute dtype)"))
    return Side(compute, f"{A}.strategy={t.strategy} (HF gate runs in the compute dtype)")


def _rollout_router_dtype(c: Context, compute: str) -> Side:
    r, pin = c.r, c.settings.moe_router_dtype
    if c.project_rollout:
        return Side(canonical_dtype(pin) if pin else compute, f"{TOP}.moe_router_dtype (project kernels)")
    if is_vllm(r.name):
        # vLLM's Qwen3-MoE gate is a ReplicatedLinear with no params_dtype: it runs in the served dtype
        # (vllm-ascend serves the same model class); no engine setting changes it.
        return Side(compute, f"{R}.dtype ({SOURCES['vllm_qwen3_moe']}; no fp32-router setting exists)")
    return Side(UNVERIFIED, f"{R}.name={r.name}: no router-dtype setting (model code decides)")


def moe_rows(c: Context) -> list[Row]:
    settings = c.settings
    ep_t, ep_r = as_size(c.tl.ep.value), as_size(c.rl.ep.value)
    t_compute = Side(*c.t.compute_dtype)
    r_dtype = c.r.dtype
    combine = settings.moe_combine
    t_project = c.project and c.t.megatron is None
    r_project = c.project_rollout
    return [
        Row(
            "moe_dispatcher",
            "MoE dispatch",
            _training_dispatcher(c, ep_t),
            _rollout_dispatcher(c, ep_r),
            required=settings.moe_dispatcher if settings.moe_dispatcher and max(ep_t, ep_r) > 1 else None,
            required_source=f"{TOP}.moe_dispatcher",
            fix=(
                f"set {A}.megatron.override_transformer_config.moe_token_dispatcher_type to the rollout family "
                f"({R}.engine_kwargs.vllm.all2all_backend: allgather_reducescatter/naive = allgather, others = alltoall)"
            ),
        ),
        Row(
            "moe_combine",
            "MoE combine order",
            Side(combine if t_project and combine else (combine and UNVERIFIED) or "engine default",
                 f"{TOP}.moe_combine" + (" (project kernels)" if t_project else " (no engine setting)")),
            Side(combine if r_project and combine else (combine and UNVERIFIED) or "engine default",
                 f"{TOP}.moe_combine" + (" (project kernels)" if r_project else " (no engine setting)")),
            only_when_deterministic=True,
            fix=f"set {TOP}.moe_combine; only the project's kernels implement a pinned combine order",
        ),
        Row(
            "moe_router_dtype",
            "MoE router dtype",
            _training_router_dtype(c, t_compute.value),
            _rollout_router_dtype(c, r_dtype),
            required=canonical_dtype(settings.moe_router_dtype) if settings.moe_router_dtype else None,
            required_source=f"{TOP}.moe_router_dtype",
            only_when_deterministic=True,
            fix=(
                f"vLLM / vllm-ascend run the Qwen3-MoE gate in {R}.dtype and have no fp32-router setting: set "
                f"{TOP}.moe_router_dtype to that dtype and leave {A}.megatron.override_transformer_config.moe_router_dtype "
                "unset (Megatron then routes in the compute dtype), or use the project's CPU engine, which honours the pin"
            ),
        ),
    ]
