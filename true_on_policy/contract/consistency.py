"""The training/rollout consistency contract, computed from the full resolved Hydra config.

Bitwise-equal log-probs on the two engines need the same arithmetic on both: the same parallel
layout (every TP/EP/CP split changes which partial sums exist and in what order they are added),
the same dtypes, the same attention kernel family, the same MoE dispatch/combine and row-parallel
reduction, the same log-prob definition and sampling support, and the same determinism
environment. :func:`build_contract` reads each of those, per side, from the real verl keys (or,
where verl has no slot, from the place the project pins it), :func:`compare` lists what differs
and how to fix it, :func:`format_table` prints both columns side by side.

Pure: imports omegaconf only through :mod:`true_on_policy.contract.determinism_plan` helpers, never verl.

Where each field is read from
-----------------------------
Training side (the engine ``actor_rollout_ref.actor.strategy`` selects; ``ref`` follows the actor
through verl's ``oc.select`` interpolations):

* megatron (MindSpeed on NPU): ``actor_rollout_ref.actor.megatron.{tensor_model_parallel_size,
  expert_model_parallel_size, expert_tensor_parallel_size (null = TP), pipeline_model_parallel_size,
  context_parallel_size, sequence_parallel, dtype}``; ``...megatron.override_transformer_config.
  {attention_backend (verl default flash), use_flash_attn_npu_batch_invariant, moe_token_dispatcher_type
  (verl default alltoall), moe_router_dtype}``.
* fsdp / fsdp2: no TP/EP/PP/CP (1) -- except on ``platform: cpu``, where TP and EP are the CPU
  backend's (:mod:`true_on_policy.kernels.tensor_parallel`), read from ``true_on_policy.{cpu_tensor_parallel_size,
  cpu_expert_parallel_size}`` (default 1); ``actor_rollout_ref.actor.fsdp_config.{mixed_precision.param_dtype
  (compute dtype, verl default bf16), model_dtype (master weights), ulysses_sequence_parallel_size}``;
  attention ``actor_rollout_ref.model.override_config.attn_implementation`` (verl default
  flash_attention_2).
* torchtitan: ``actor_rollout_ref.actor.torchtitan.{tensor_parallel_size, expert_parallel_size,
  pipeline_parallel_size, context_parallel_size, dtype, attn_type}``.
* veomni: ``actor_rollout_ref.actor.veomni.{expert_parallel_size, ulysses_parallel_size,
  attn_implementation}``.

Rollout side (``actor_rollout_ref.rollout.name``):

* vllm / sglang: ``actor_rollout_ref.rollout.{tensor_model_parallel_size, data_parallel_size,
  expert_parallel_size, pipeline_model_parallel_size, dtype, logprobs_mode, calculate_log_probs,
  top_p, top_k, temperature}``. vLLM's EP group is DP x TP (``vllm/config/parallel.py``) and verl
  requires ``expert_parallel_size == TP * DP`` (``verl/workers/config/rollout.py``), so the effective
  rollout EP is TP*DP when EP is on, else 1; experts are then unsplit (ETP 1) or TP*DP-split.
  ``engine_kwargs.vllm.{attention_backend, all2all_backend (vLLM default allgather_reducescatter),
  block_size, decode_context_parallel_size, prefill_context_parallel_size, compilation_config.pass_config.
  enable_sp, additional_config.rl_config.*, additional_config.enable_flashcomm1}``.
* cpu: the project's CPU engine, the consistent kernels; TP = ``rollout.tensor_model_parallel_size``,
  EP = ``rollout.expert_parallel_size`` (as declared: no vLLM TP*DP rule), sharded by
  :mod:`true_on_policy.kernels.tensor_parallel` (row-parallel combine: all-gather + ordered fp32 fold;
  experts whole on their rank, no token dispatch); DP 1.

Keys verl has no slot for are pinned in the ``true_on_policy:`` section (read with ``.get`` until
settings.py declares them): ``cpu_tensor_parallel_size``, ``cpu_expert_parallel_size`` (the CPU
training side's TP/EP), ``attention_backend``, ``row_parallel_reduction``, ``moe_dispatcher``,
``moe_combine``, ``moe_router_dtype`` (a pin, when set, is the value both sides must have) and
``stack_versions`` (declared accelerator-stack versions, used where a package is not installed).

Determinism environment: the plan from :mod:`true_on_policy.contract.determinism_plan` is applied first
(idempotent), then the training processes' environment (``ray_kwargs.ray_init.runtime_env.env_vars``)
is compared with what the rollout engine's processes end up with (the same runtime env plus what
vLLM / vllm-ascend force under ``VLLM_BATCH_INVARIANT=1``), on the keys that decide a reduction order.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from true_on_policy.contract import determinism_plan as denv

UNVERIFIED = "unverified"  # a side whose value no engine setting determines: never a mismatch, always flagged
AUTO = "auto"  # engine picks at run time: a mismatch when deterministic
NA = "n/a"

INFO, STRICT, REQUIRE = "info", "strict", "require"


@dataclasses.dataclass(frozen=True)
class Side:
    value: Any
    source: str
    display: str | None = None

    def show(self) -> str:
        return str(self.display if self.display is not None else self.value)


@dataclasses.dataclass(frozen=True)
class Row:
    field: str
    title: str
    training: Side
    rollout: Side
    kind: str = STRICT  # info | strict | require
    required: Any = None  # pinned value both known sides must have (strict) / the rollout side must have (require)
    required_source: str = ""
    reject_auto: bool = False  # under determinism, "auto" is an unpinned kernel choice
    only_when_deterministic: bool = False
    fix: str = ""


@dataclasses.dataclass(frozen=True)
class Mismatch:
    field: str
    title: str
    training: Any
    rollout: Any
    training_source: str
    rollout_source: str
    reason: str
    fix: str

    def line(self) -> str:
        return (
            f"{self.title} [{self.field}]: training={_fmt(self.training)} ({self.training_source}) vs "
            f"rollout={_fmt(self.rollout)} ({self.rollout_source}): {self.reason}; fix: {self.fix}"
        )

    __str__ = line


@dataclasses.dataclass(frozen=True)
class Contract:
    platform: str
    deterministic: bool
    training_engine: str
    rollout_engine: str
    rows: tuple[Row, ...]
    notes: tuple[str, ...] = ()
    plan: Any = None

    def row(self, field: str) -> Row:
        for row in self.rows:
            if row.field == field:
                return row
        raise KeyError(field)

    def replace_row(self, field: str, **changes: Any) -> Contract:
        """A copy with one row changed (``training=``/``rollout=`` may be plain values)."""
        rows = []
        for row in self.rows:
            if row.field == field:
                for side in ("training", "rollout"):
                    if side in changes and not isinstance(changes[side], Side):
                        old = getattr(row, side)
                        changes[side] = Side(changes[side], old.source)
                row = dataclasses.replace(row, **changes)
            rows.append(row)
        return dataclasses.replace(self, rows=tuple(rows))

    def as_dict(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "deterministic": self.deterministic,
            "training_engine": self.training_engine,
            "rollout_engine": self.rollout_engine,
            "rows": [
                {
                    "field": r.field,
                    "title": r.title,
                    "kind": r.kind,
                    "training": r.training.value,
                    "training_source": r.training.source,
                    "rollout": r.rollout.value,
                    "rollout_source": r.rollout.source,
                    "required": r.required,
                    "status": status(self, r),
                }
                for r in self.rows
            ],
            "notes": list(self.notes),
        }


def _fmt(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


# --------------------------------------------------------------------------------------------
# config access and canonical names
# --------------------------------------------------------------------------------------------

_get = denv._get  # noqa: SLF001 - shared tolerant getter (DictConfig or dict)

A = "actor_rollout_ref.actor"
R = "actor_rollout_ref.rollout"
M = "actor_rollout_ref.model"
TOP = "true_on_policy"
ENV = denv.ENV_PATH

# The CPU backend's training-side TP/EP (verl's FSDP engine has no slot for them) and the names of its
# collectives; the same strings as true_on_policy.kernels.tensor_parallel.{ROW_PARALLEL_REDUCTION, MOE_DISPATCH}.
CPU_TP_KEY = f"{TOP}.cpu_tensor_parallel_size"
CPU_EP_KEY = f"{TOP}.cpu_expert_parallel_size"
CPU_ROW_PARALLEL = "all_gather+ordered_fold"
CPU_MOE_DISPATCH = "replicated"


def _int(value: Any, default: int = 1) -> int:
    if value is None or value == "":
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


_DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "torch.float16": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "torch.float32": "float32",
    "fp64": "float64",
    "float64": "float64",
    "auto": AUTO,
}


def canonical_dtype(value: Any) -> str:
    if value is None:
        return AUTO
    return _DTYPES.get(str(value).strip().lower(), str(value))


_ATTENTION = {
    # Megatron override_transformer_config.attention_backend (mcore AttnBackend names)
    "flash": "flash_attn",
    "fused": "te_fused",
    "unfused": "eager",
    "local": "local",
    # HF attn_implementation
    "flash_attention_2": "flash_attn",
    "flash_attention_3": "flash_attn",
    "sdpa": "sdpa",
    "eager": "eager",
    "flex_attention": "flex",
    "flex": "flex",
    # vLLM AttentionBackendEnum names
    "flash_attn": "flash_attn",
    "flashinfer": "flashinfer",
    "triton_attn": "triton",
    "flex_attention_backend": "flex",
    "torch_sdpa": "sdpa",
    # SGLang --attention-backend
    "fa3": "flash_attn",
    "fa4": "flash_attn",
    "triton": "triton",
    "consistent": "consistent",
    "auto": AUTO,
}


def canonical_attention(value: Any) -> str:
    if value is None:
        return AUTO
    text = str(value).strip()
    if text.startswith("AttnBackend."):
        text = text.split(".", 1)[1]
    return _ATTENTION.get(text.lower(), text.lower())


_VLLM_ALLGATHER_BACKENDS = {"naive", "allgather_reducescatter"}


def _bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


# --------------------------------------------------------------------------------------------
# per side readers
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Layout:
    tp: Side
    ep: Side
    etp: Side
    pp: Side
    cp: Side
    dp: Side
    extra: dict[str, Side]


def _training_layout(cfg: Any, strategy: str, world: int, platform: str = "") -> _Layout:
    extra: dict[str, Side] = {}
    if strategy == "megatron":
        base = f"{A}.megatron"
        tp = _int(_get(cfg, f"{base}.tensor_model_parallel_size"))
        ep = _int(_get(cfg, f"{base}.expert_model_parallel_size"))
        etp_raw = _get(cfg, f"{base}.expert_tensor_parallel_size")
        etp = _int(etp_raw, tp)
        pp = _int(_get(cfg, f"{base}.pipeline_model_parallel_size"))
        cp = _int(_get(cfg, f"{base}.context_parallel_size"))
        layout = _Layout(
            Side(tp, f"{base}.tensor_model_parallel_size"),
            Side(ep, f"{base}.expert_model_parallel_size"),
            Side(etp, f"{base}.expert_tensor_parallel_size" + (" (null = TP)" if etp_raw is None else "")),
            Side(pp, f"{base}.pipeline_model_parallel_size"),
            Side(cp, f"{base}.context_parallel_size"),
            Side(0, ""),
            extra,
        )
    elif strategy == "torchtitan":
        base = f"{A}.torchtitan"
        tp = _int(_get(cfg, f"{base}.tensor_parallel_size"))
        ep = _int(_get(cfg, f"{base}.expert_parallel_size"))
        layout = _Layout(
            Side(tp, f"{base}.tensor_parallel_size"),
            Side(ep, f"{base}.expert_parallel_size"),
            Side(UNVERIFIED if ep > 1 else tp, f"{base} (no expert-TP key in verl's torchtitan config)"),
            Side(_int(_get(cfg, f"{base}.pipeline_parallel_size")), f"{base}.pipeline_parallel_size"),
            Side(_int(_get(cfg, f"{base}.context_parallel_size")), f"{base}.context_parallel_size"),
            Side(0, ""),
            extra,
        )
    elif strategy == "veomni":
        base = f"{A}.veomni"
        ep = _int(_get(cfg, f"{base}.expert_parallel_size"))
        layout = _Layout(
            Side(1, f"{A}.strategy=veomni (no tensor parallelism)"),
            Side(ep, f"{base}.expert_parallel_size"),
            Side(1, f"{A}.strategy=veomni (experts unsplit)"),
            Side(1, f"{A}.strategy=veomni (no pipeline parallelism)"),
            Side(1, f"{A}.strategy=veomni (no context parallelism)"),
            Side(0, ""),
            extra,
        )
        extra["ulysses"] = Side(_int(_get(cfg, f"{base}.ulysses_parallel_size")), f"{base}.ulysses_parallel_size")
    else:  # fsdp, fsdp2, fsdp_turbo and any data-parallel engine
        src = f"{A}.strategy={strategy} (FSDP shards parameters, no model parallelism)"
        layout = _Layout(Side(1, src), Side(1, src), Side(1, src), Side(1, src), Side(1, src), Side(0, ""), extra)
        if platform == "cpu":  # the CPU backend shards the same model code (true_on_policy.kernels.tensor_parallel)
            layout.tp = Side(_int(_get(cfg, CPU_TP_KEY)), f"{CPU_TP_KEY} (CPU backend, true_on_policy.kernels.tensor_parallel)")
            layout.ep = Side(_int(_get(cfg, CPU_EP_KEY)), f"{CPU_EP_KEY} (CPU backend, experts whole on their rank)")
        extra["ulysses"] = Side(
            _int(_get(cfg, f"{A}.fsdp_config.ulysses_sequence_parallel_size")),
            f"{A}.fsdp_config.ulysses_sequence_parallel_size",
        )
    denom = max(1, layout.tp.value if isinstance(layout.tp.value, int) else 1) * max(1, layout.pp.value) * max(
        1, layout.cp.value
    )
    layout.dp = Side(
        world // denom if world and world >= denom else NA, "trainer.nnodes * trainer.n_gpus_per_node / (TP * PP * CP)"
    )
    return layout


def _rollout_layout(cfg: Any, name: str, notes: list[str]) -> _Layout:
    extra: dict[str, Side] = {}
    if name == "cpu":
        src = f"{R}.name=cpu (project CPU engine)"
        tp = _int(_get(cfg, f"{R}.tensor_model_parallel_size"))
        ep = _int(_get(cfg, f"{R}.expert_parallel_size"))
        one = Side(1, src)
        return _Layout(
            Side(tp, f"{R}.tensor_model_parallel_size (cpu engine: true_on_policy.kernels.tensor_parallel)"),
            Side(ep, f"{R}.expert_parallel_size (cpu engine: as declared, experts whole on their rank)"),
            one,
            one,
            one,
            Side(1, src),
            extra,
        )
    tp = _int(_get(cfg, f"{R}.tensor_model_parallel_size"), 2)
    dp = _int(_get(cfg, f"{R}.data_parallel_size"))
    ep_declared = _int(_get(cfg, f"{R}.expert_parallel_size"))
    ep_on = ep_declared > 1
    ep_src = f"{R}.expert_parallel_size={ep_declared} (EP on => vLLM EP group = TP*DP)"
    if ep_on and ep_declared != tp * dp:
        notes.append(
            f"{R}.expert_parallel_size={ep_declared} but TP*DP={tp * dp}: verl's RolloutConfig rejects this "
            "(verl/workers/config/rollout.py)"
        )
    kwargs = f"{R}.engine_kwargs.{'sglang' if name == 'sglang' else 'vllm'}"
    dcp = _int(_get(cfg, f"{kwargs}.decode_context_parallel_size"))
    pcp = _int(_get(cfg, f"{kwargs}.prefill_context_parallel_size"))
    return _Layout(
        Side(tp, f"{R}.tensor_model_parallel_size"),
        Side(tp * dp if ep_on else 1, ep_src, display=f"{tp * dp if ep_on else 1}"),
        Side(1 if ep_on else tp * dp, f"{R}: experts unsplit under EP, else split TP*DP ways"),
        Side(_int(_get(cfg, f"{R}.pipeline_model_parallel_size")), f"{R}.pipeline_model_parallel_size"),
        Side(max(dcp, pcp), f"{kwargs}.decode_context_parallel_size / prefill_context_parallel_size"),
        Side(dp, f"{R}.data_parallel_size"),
        extra,
    )


def _training_compute_dtype(cfg: Any, strategy: str) -> Side:
    if strategy == "megatron":
        return Side(canonical_dtype(_get(cfg, f"{A}.megatron.dtype", "bfloat16")), f"{A}.megatron.dtype")
    if strategy == "torchtitan":
        return Side(canonical_dtype(_get(cfg, f"{A}.torchtitan.dtype", "bfloat16")), f"{A}.torchtitan.dtype")
    if strategy == "veomni":
        on = _bool(_get(cfg, f"{A}.veomni.mixed_precision", True))
        return Side("bfloat16" if on else "float32", f"{A}.veomni.mixed_precision")
    param = _get(cfg, f"{A}.fsdp_config.mixed_precision.param_dtype")
    return Side(
        canonical_dtype(param or "bf16"),
        f"{A}.fsdp_config.mixed_precision.param_dtype" + ("" if param else " (verl default bf16)"),
    )


def _training_master_dtype(cfg: Any, strategy: str) -> Side:
    if strategy.startswith("fsdp"):
        return Side(canonical_dtype(_get(cfg, f"{A}.fsdp_config.model_dtype", "fp32")), f"{A}.fsdp_config.model_dtype")
    if strategy == "megatron":
        return Side("float32", f"{A}.megatron.use_distributed_optimizer (fp32 main params)")
    return Side("float32", f"{A}.strategy={strategy} (optimizer keeps fp32 weights)")


def _training_attention(cfg: Any, strategy: str, platform: str, deterministic: bool) -> Side:
    if platform == "cpu" and deterministic:
        return Side("consistent", f"{TOP}.deterministic=true (project consistent kernels)")
    if strategy == "megatron":
        tc = f"{A}.megatron.override_transformer_config"
        value = canonical_attention(_get(cfg, f"{tc}.attention_backend", "flash"))
        bi = _bool(_get(cfg, f"{tc}.use_flash_attn_npu_batch_invariant", False))
        display = value + (" (npu batch-invariant)" if bi else "")
        return Side(value, f"{tc}.attention_backend" + (" + use_flash_attn_npu_batch_invariant" if bi else ""), display)
    if strategy == "torchtitan":
        return Side(canonical_attention(_get(cfg, f"{A}.torchtitan.attn_type", "flex")), f"{A}.torchtitan.attn_type")
    if strategy == "veomni":
        return Side(
            canonical_attention(_get(cfg, f"{A}.veomni.attn_implementation", "flash_attention_2")),
            f"{A}.veomni.attn_implementation",
        )
    impl = _get(cfg, f"{M}.override_config.attn_implementation")
    return Side(
        canonical_attention(impl or "flash_attention_2"),
        f"{M}.override_config.attn_implementation" + ("" if impl else " (verl default flash_attention_2)"),
    )


def _project_rollout(name: str, platform: str) -> bool:
    """The rollout runs the project's kernels: its CPU engine, or vLLM-CPU through true_on_policy.vllm_adapter."""
    return name == "cpu" or (name == "vllm" and platform == "cpu")


def _rollout_attention(cfg: Any, name: str, platform: str, deterministic: bool) -> Side:
    if _project_rollout(name, platform):
        if deterministic:
            return Side("consistent", f"{R}.name=cpu + {TOP}.deterministic=true")
        return Side(AUTO, f"{R}.name=cpu")
    if name == "sglang":
        key = f"{R}.engine_kwargs.sglang.attention_backend"
        return Side(canonical_attention(_get(cfg, key)), key)
    key = f"{R}.engine_kwargs.vllm.attention_backend"
    explicit = _get(cfg, key)
    if platform == "ascend":
        rl = f"{R}.engine_kwargs.vllm.additional_config.rl_config"
        if _bool(_get(cfg, f"{rl}.enabled", False)) and _bool(_get(cfg, f"{rl}.enable_training_consistency", False)):
            return Side("flash_attn", f"{rl}.enable_training_consistency", "flash_attn (vllm-ascend training-consistent FA)")
        if explicit is None:
            return Side(AUTO, f"{rl}.enable_training_consistency unset; vllm-ascend picks its attention backend")
    return Side(canonical_attention(explicit), key + ("" if explicit else " (unset: vLLM auto-selects)"))


def _rollout_env(cfg: Any) -> dict[str, str]:
    env = _get(cfg, ENV, {}) or {}
    return {str(k): str(v) for k, v in (env.items() if hasattr(env, "items") else [])}


def _rollout_row_parallel(cfg: Any, name: str, platform: str, tp: int, env: Mapping[str, str]) -> Side:
    if tp <= 1:
        return Side(denv.ROW_PARALLEL_NONE, f"{R}.tensor_model_parallel_size=1")
    if name == "cpu":
        return Side(CPU_ROW_PARALLEL, f"{R}.name=cpu, {R}.tensor_model_parallel_size={tp} (true_on_policy.kernels.tensor_parallel)")
    if name == "vllm" and platform == "ascend":
        key = f"{R}.engine_kwargs.vllm.additional_config.enable_flashcomm1"
        on = _bool(_get(cfg, key, False)) or _bool(env.get("VLLM_ASCEND_ENABLE_FLASHCOMM1", "0"))
        src = f"{ENV}.VLLM_ASCEND_ENABLE_FLASHCOMM1 / {key}"
        return Side(denv.ROW_PARALLEL_RS_AG if on else denv.ROW_PARALLEL_ALL_REDUCE, src)
    if name == "vllm":
        comp = _maybe_json(_get(cfg, f"{R}.engine_kwargs.vllm.compilation_config", {})) or {}
        pass_config = comp.get("pass_config", {}) if hasattr(comp, "get") else {}
        on = _bool(pass_config.get("enable_sp", False)) or _bool(pass_config.get("enable_sequence_parallelism", False))
        src = f"{R}.engine_kwargs.vllm.compilation_config.pass_config.enable_sp"
        return Side(denv.ROW_PARALLEL_RS_AG if on else denv.ROW_PARALLEL_ALL_REDUCE, src)
    return Side(denv.ROW_PARALLEL_ALL_REDUCE, f"{R}.name={name} (tensor-parallel all-reduce)")


def _training_dispatcher(cfg: Any, strategy: str, ep: int, platform: str, deterministic: bool, pin: Any) -> Side:
    if platform == "cpu" and deterministic and not strategy == "megatron":
        return Side(pin or ("local" if ep <= 1 else CPU_MOE_DISPATCH), f"{TOP}.moe_dispatcher (project kernels)")
    if strategy == "megatron":
        key = f"{A}.megatron.override_transformer_config.moe_token_dispatcher_type"
        value = _get(cfg, key)
        if ep <= 1:
            return Side("local", f"{A}.megatron.expert_model_parallel_size=1")
        return Side(str(value or "alltoall"), key + ("" if value else " (verl default alltoall)"))
    if ep <= 1:
        return Side("local", f"{A}.strategy={strategy} (experts on every rank)")
    return Side(UNVERIFIED, f"{A}.strategy={strategy} (no dispatcher key)")


def _rollout_dispatcher(cfg: Any, name: str, ep: int, platform: str, deterministic: bool, pin: Any) -> Side:
    if _project_rollout(name, platform):
        return Side(pin or ("local" if ep <= 1 else CPU_MOE_DISPATCH), f"{TOP}.moe_dispatcher (project CPU engine)")
    if ep <= 1:
        return Side("local", f"{R}.expert_parallel_size<=1 (experts TP-split, no dispatch)")
    if name == "vllm" and platform == "ascend":
        return Side(UNVERIFIED, "vllm-ascend selects its MoE communication per batch (no setting)")
    if name == "vllm":
        key = f"{R}.engine_kwargs.vllm.all2all_backend"
        backend = str(_get(cfg, key) or "allgather_reducescatter")
        family = "allgather" if backend in _VLLM_ALLGATHER_BACKENDS else "alltoall"
        return Side(family, key + ("" if _get(cfg, key) else " (vLLM default allgather_reducescatter)"), f"{family} ({backend})")
    return Side(UNVERIFIED, f"{R}.name={name} (no dispatcher key)")


def _training_router_dtype(cfg: Any, strategy: str, compute: str, platform: str, deterministic: bool, pin: Any) -> Side:
    if platform == "cpu" and deterministic and strategy != "megatron":
        return Side(canonical_dtype(pin) if pin else compute, f"{TOP}.moe_router_dtype (project kernels)")
    if strategy == "megatron":
        key = f"{A}.megatron.override_transformer_config.moe_router_dtype"
        value = _get(cfg, key)
        return Side(canonical_dtype(value) if value else compute, key + ("" if value else " (unset: compute dtype)"))
    return Side(compute, f"{A}.strategy={strategy} (HF gate runs in the compute dtype)")


def _rollout_router_dtype(name: str, compute: str, deterministic: bool, pin: Any, platform: str = "") -> Side:
    if _project_rollout(name, platform):
        return Side(canonical_dtype(pin) if pin else compute, f"{TOP}.moe_router_dtype (project CPU engine)")
    return Side(UNVERIFIED, f"{R}.name={name}: no router-dtype setting (model code decides)")


def _training_batch_invariant(cfg: Any, strategy: str, platform: str, deterministic: bool) -> Side:
    if not deterministic:
        return Side("off", f"{TOP}.deterministic=false")
    if platform == "cpu":
        return Side("on", f"{TOP}.deterministic=true (project consistent kernels)")
    if platform == "ascend" and strategy == "megatron":
        key = f"{A}.megatron.override_transformer_config.use_flash_attn_npu_batch_invariant"
        on = _bool(_get(cfg, key, False))
        return Side("on" if on else "off", key)
    return Side(
        UNVERIFIED,
        f"{A}.strategy={strategy} on {platform}: verl 0.9.1 has no batch-invariant GEMM switch for training",
    )


def _rollout_batch_invariant(cfg: Any, name: str, platform: str, deterministic: bool, env: Mapping[str, str]) -> Side:
    if _project_rollout(name, platform):
        return Side("on" if deterministic else "off", f"{R}.name=cpu + {TOP}.deterministic")
    rl = f"{R}.engine_kwargs.vllm.additional_config.rl_config"
    rl_on = _bool(_get(cfg, f"{rl}.enabled", False)) and _bool(_get(cfg, f"{rl}.enable_batch_invariant", False))
    on = _bool(env.get("VLLM_BATCH_INVARIANT", "0")) or rl_on
    return Side("on" if on else "off", f"{ENV}.VLLM_BATCH_INVARIANT" + (f" / {rl}.enable_batch_invariant" if platform == "ascend" else ""))


def _logprobs(cfg: Any, name: str) -> tuple[Side, Side]:
    t = _get(cfg, f"{R}.temperature", 1.0)
    training = Side("logprob(softmax(logits/T))", f"{A} log-prob (temperature {R}.temperature={t})")
    if not _bool(_get(cfg, f"{R}.calculate_log_probs", False)):
        return training, Side("not returned", f"{R}.calculate_log_probs=false")
    mode = str(_get(cfg, f"{R}.logprobs_mode", "processed_logprobs") or "processed_logprobs")
    src = f"{R}.logprobs_mode={mode}"
    if mode == "processed_logprobs":
        value = "logprob(softmax(logits/T))"
    elif mode == "raw_logprobs":
        value = "logprob(softmax(logits/T))" if float(t or 1.0) == 1.0 else "logprob(softmax(logits))"
    else:
        value = mode
    return training, Side(value, src)


def _sampling(cfg: Any) -> tuple[Side, Side]:
    top_p = _get(cfg, f"{R}.top_p", 1.0)
    top_k = _get(cfg, f"{R}.top_k", -1)
    full = (top_p is None or float(top_p) >= 1.0) and (top_k is None or int(top_k) <= 0)
    value = "full vocabulary" if full else f"truncated (top_p={top_p}, top_k={top_k})"
    return (
        Side("full vocabulary", f"{A} log-prob over the whole vocabulary"),
        Side(value, f"{R}.top_p / {R}.top_k"),
    )


def _env_display(env: Mapping[str, str], other: Mapping[str, str]) -> str:
    if not env:
        return "none"
    differing = [k for k in env if other.get(k) != env[k]] + [k for k in other if k not in env]
    if not differing:
        return f"{len(env)} pinned keys (listed below)"
    return ", ".join(f"{k}={env.get(k, '<unset>')}" for k in differing)


def _reduction_env(env: Mapping[str, str], platform: str) -> dict[str, str]:
    return {k: env[k] for k in denv.REDUCTION_ENV_KEYS.get(platform, ()) if k in env}


# --------------------------------------------------------------------------------------------
# build / compare / format
# --------------------------------------------------------------------------------------------


def build_contract(
    config: Any,
    *,
    plan: Any = None,
    detected: Mapping[str, str | None] | None = None,
    apply_plan: bool = True,
) -> Contract:
    """Compute the two-column contract from the resolved config.

    The determinism plan for the config is computed (or taken from ``plan``) and merged first, so
    the contract describes what the launch will run with; ``detected`` feeds installed versions
    (default: detect with importlib.metadata).
    """
    section = _get(config, TOP, {}) or {}
    platform = str(_get(section, "platform", "cpu"))
    deterministic = bool(_get(section, "deterministic", True))
    if plan is None:
        plan = denv.plan_for_config(config, detected=detected)
    cfg = denv.apply_to_config(config, plan) if apply_plan else config
    notes: list[str] = list(plan.notes) + [f"not emitted: {s}" for s in plan.skipped]

    strategy = str(_get(cfg, f"{A}.strategy", "fsdp"))
    name = str(_get(cfg, f"{R}.name", "vllm"))
    world = _int(_get(cfg, "trainer.nnodes"), 1) * _int(_get(cfg, "trainer.n_gpus_per_node"), 1)
    pins = {k: _get(section, k) for k in ("attention_backend", "row_parallel_reduction", "moe_dispatcher", "moe_combine", "moe_router_dtype")}

    tl = _training_layout(cfg, strategy, world, platform)
    rl = _rollout_layout(cfg, name, notes)
    cpu_sides = [s for s, on in ((tl, platform == "cpu"), (rl, name == "cpu")) if on]
    if any(_int(side.tp.value) > 1 or _int(side.ep.value) > 1 for side in cpu_sides):
        notes.append(
            "CPU TP/EP > 1 is true_on_policy.kernels.tensor_parallel.shard_model (gloo, all-gather + ordered fp32 fold), "
            "proven at library level (tests/test_tensor_parallel.py); verl's FSDP trainer and the Ray-served cpu "
            "rollout replica do not shard yet"
        )
    env = _rollout_env(cfg)
    rollout_env = {**env, **(plan.rollout_forced_env if _bool(env.get("VLLM_BATCH_INVARIANT", "0")) and name == "vllm" else {})}

    t_compute = _training_compute_dtype(cfg, strategy)
    r_dtype = canonical_dtype(_get(cfg, f"{R}.dtype", "bfloat16"))
    rows: list[Row] = [
        Row("engine", "engines", Side(strategy, f"{A}.strategy"), Side(name, f"{R}.name"), kind=INFO),
        Row(
            "tp",
            "TP (tensor parallel)",
            tl.tp,
            rl.tp,
            fix=f"set {R}.tensor_model_parallel_size={tl.tp.value} (or the training TP, {tl.tp.source}, to {rl.tp.value})",
        ),
        Row(
            "ep",
            "EP (expert parallel)",
            tl.ep,
            rl.ep,
            fix=f"make the training EP ({tl.ep.source}) equal the rollout EP group = {R}.tensor_model_parallel_size * "
            f"{R}.data_parallel_size, with {R}.expert_parallel_size set to that product (or EP off on both sides); "
            f"now training={tl.ep.value}, rollout={rl.ep.value}",
        ),
        Row(
            "etp",
            "expert TP",
            tl.etp,
            rl.etp,
            fix=f"with rollout EP on set {A}.megatron.expert_tensor_parallel_size=1; with EP off experts are split TP*DP ways",
        ),
        Row(
            "pp",
            "PP (pipeline parallel)",
            tl.pp,
            rl.pp,
            fix=f"set {tl.pp.source} and {R}.pipeline_model_parallel_size to the same value (verl's vLLM rollout supports 1)",
        ),
        Row(
            "cp",
            "CP (context parallel)",
            tl.cp,
            rl.cp,
            fix=f"set {A}.megatron.context_parallel_size and {R}.engine_kwargs.vllm.decode/prefill_context_parallel_size to 1 "
            "(ring-attention and decode-CP merge partial softmaxes in different orders)",
        ),
        Row("dp", "DP (data parallel)", tl.dp, rl.dp, kind=INFO),
    ]
    for key, side in tl.extra.items():
        rows.append(Row(key, "Ulysses SP (heads<->sequence all-to-all, no reduction)", side, Side(NA, "rollout has no Ulysses SP"), kind=INFO))
    rows += [
        Row(
            "compute_dtype",
            "compute dtype",
            t_compute,
            Side(r_dtype, f"{R}.dtype"),
            fix=f"set {R}.dtype={t_compute.value} (the training compute dtype, {t_compute.source})",
        ),
        Row(
            "param_dtype",
            "parameter dtype (master / served)",
            _training_master_dtype(cfg, strategy),
            Side(r_dtype, f"{R}.dtype (weights synced and cast once)"),
            kind=INFO,
        ),
    ]
    t_attn = _training_attention(cfg, strategy, platform, deterministic)
    r_attn = _rollout_attention(cfg, name, platform, deterministic)
    rows.append(
        Row(
            "attention",
            "attention backend",
            t_attn,
            r_attn,
            required=canonical_attention(pins["attention_backend"]) if pins["attention_backend"] else None,
            required_source=f"{TOP}.attention_backend",
            reject_auto=True,
            only_when_deterministic=True,
            fix=(
                f"pin the same kernel family on both sides: {A}.megatron.override_transformer_config.attention_backend "
                f"/ {M}.override_config.attn_implementation and {R}.engine_kwargs.vllm.attention_backend "
                f"(Ascend: {R}.engine_kwargs.vllm.additional_config.rl_config.enable_training_consistency=true)"
            ),
        )
    )
    t_rp = Side(denv.training_row_parallel(cfg), f"{A}.megatron.sequence_parallel (TP>1: true = reduce-scatter + all-gather)")
    if platform == "cpu" and strategy not in ("megatron", "torchtitan") and _int(tl.tp.value) > 1:
        t_rp = Side(CPU_ROW_PARALLEL, f"{CPU_TP_KEY}={tl.tp.value} (true_on_policy.kernels.tensor_parallel)")
    r_rp = _rollout_row_parallel(cfg, name, platform, _int(rl.tp.value), env)
    rows.append(
        Row(
            "row_parallel",
            "row-parallel reduction",
            t_rp,
            r_rp,
            required=pins["row_parallel_reduction"] if pins["row_parallel_reduction"] and _int(tl.tp.value) > 1 else None,
            required_source=f"{TOP}.row_parallel_reduction",
            fix=(
                f"match {A}.megatron.sequence_parallel with the rollout: Ascend {ENV}.VLLM_ASCEND_ENABLE_FLASHCOMM1=1 "
                f"(FlashComm1 = reduce-scatter + all-gather); CUDA keep TP=1 or sequence_parallel=false (vLLM's SP pass "
                f"is not batch invariant); CPU: set {CPU_TP_KEY} equal to {R}.tensor_model_parallel_size"
            ),
        )
    )
    ep_t, ep_r = _int(tl.ep.value), _int(rl.ep.value)
    rows += [
        Row(
            "moe_dispatcher",
            "MoE dispatch",
            _training_dispatcher(cfg, strategy, ep_t, platform, deterministic, pins["moe_dispatcher"]),
            _rollout_dispatcher(cfg, name, ep_r, platform, deterministic, pins["moe_dispatcher"]),
            required=pins["moe_dispatcher"] if pins["moe_dispatcher"] and max(ep_t, ep_r) > 1 else None,
            required_source=f"{TOP}.moe_dispatcher",
            fix=(
                f"set {A}.megatron.override_transformer_config.moe_token_dispatcher_type to the rollout family "
                f"({R}.engine_kwargs.vllm.all2all_backend: allgather_reducescatter/naive = allgather, others = alltoall)"
            ),
        ),
        Row(
            "moe_combine",
            "MoE combine order",
            Side(pins["moe_combine"] if platform == "cpu" and pins["moe_combine"] else (pins["moe_combine"] and UNVERIFIED) or "engine default",
                 f"{TOP}.moe_combine" + (" (project kernels)" if platform == "cpu" else " (no engine setting)")),
            Side(pins["moe_combine"] if name == "cpu" and pins["moe_combine"] else (pins["moe_combine"] and UNVERIFIED) or "engine default",
                 f"{TOP}.moe_combine" + (" (project CPU engine)" if name == "cpu" else " (no engine setting)")),
            only_when_deterministic=True,
            fix=f"set {TOP}.moe_combine; only the project's kernels implement a pinned combine order",
        ),
        Row(
            "moe_router_dtype",
            "MoE router dtype",
            _training_router_dtype(cfg, strategy, t_compute.value, platform, deterministic, pins["moe_router_dtype"]),
            _rollout_router_dtype(name, r_dtype, deterministic, pins["moe_router_dtype"], platform),
            required=canonical_dtype(pins["moe_router_dtype"]) if pins["moe_router_dtype"] else None,
            required_source=f"{TOP}.moe_router_dtype",
            only_when_deterministic=True,
            fix=f"set {A}.megatron.override_transformer_config.moe_router_dtype to {TOP}.moe_router_dtype",
        ),
    ]
    t_lp, r_lp = _logprobs(cfg, name)
    rows.append(Row("logprobs", "log-prob definition", t_lp, r_lp, fix=f"set {R}.calculate_log_probs=true and {R}.logprobs_mode=processed_logprobs"))
    t_s, r_s = _sampling(cfg)
    rows.append(Row("sampling", "sampling support", t_s, r_s, fix=f"set {R}.top_p=1.0 and {R}.top_k=-1 (training log-probs are full-vocabulary)"))
    rows.append(
        Row(
            "batch_invariant",
            "batch-invariant kernels",
            _training_batch_invariant(cfg, strategy, platform, deterministic),
            _rollout_batch_invariant(cfg, name, platform, deterministic, env),
            only_when_deterministic=True,
            fix=f"set {TOP}.deterministic=true so the determinism plan switches both engines' kernels",
        )
    )
    t_env, r_env = _reduction_env(env, platform), _reduction_env(rollout_env, platform)
    rows.append(
        Row(
            "determinism_env",
            "determinism environment",
            Side(t_env or "none", f"{ENV} (training processes)", _env_display(t_env, r_env)),
            Side(r_env or "none", f"{ENV} + rollout engine overrides under VLLM_BATCH_INVARIANT=1", _env_display(r_env, t_env)),
            only_when_deterministic=True,
            fix=f"remove hand-set reduction variables from {ENV}; the determinism plan sets the values the rollout engine forces",
        )
    )
    if name == "vllm" and platform == "cpu":  # vLLM-CPU with true_on_policy.vllm_adapter
        rows.append(
            Row(
                "eager",
                "vLLM eager mode",
                Side(NA, "training runs eagerly"),
                Side(_bool(_get(cfg, f"{R}.enforce_eager", False)), f"{R}.enforce_eager"),
                kind=REQUIRE,
                required=True,
                required_source="vLLM adapter (compiled graphs broke bitwise equality)",
                only_when_deterministic=True,
                fix=f"set {R}.enforce_eager=true",
            )
        )
        sleep = _bool(_get(cfg, f"{R}.enable_sleep_mode", True)) or _bool(_get(cfg, f"{R}.free_cache_engine", True))
        rows.append(
            Row(
                "sleep_mode",
                "vLLM sleep mode",
                Side(NA, "training side"),
                Side(sleep, f"{R}.enable_sleep_mode / {R}.free_cache_engine"),
                kind=REQUIRE,
                required=False,
                required_source="vLLM-CPU has no sleep mode",
                fix=f"set {R}.enable_sleep_mode=false and {R}.free_cache_engine=false",
            )
        )
    if name == "vllm" and platform == "ascend":
        bs = _get(cfg, f"{R}.engine_kwargs.vllm.block_size")
        rows.append(
            Row(
                "kv_block_size",
                "KV block size",
                Side(NA, "training has no paged KV cache"),
                Side(_int(bs, 0) or AUTO, f"{R}.engine_kwargs.vllm.block_size"),
                kind=REQUIRE,
                required=128,
                required_source="determinism plan (fixed KV block size 128)",
                only_when_deterministic=True,
                fix=f"set {R}.engine_kwargs.vllm.block_size=128",
            )
        )
    return Contract(
        platform=platform,
        deterministic=deterministic,
        training_engine=strategy,
        rollout_engine=name,
        rows=tuple(rows),
        notes=tuple(dict.fromkeys(notes)),
        plan=plan,
    )


def status(contract: Contract, row: Row) -> str:
    """ok | mismatch | unverified | info | off (not checked when not deterministic)."""
    return _check(contract, row)[0]


def _check(contract: Contract, row: Row) -> tuple[str, str]:
    if row.kind == INFO:
        return "info", ""
    if row.only_when_deterministic and not contract.deterministic:
        return "off", ""
    t, r = row.training.value, row.rollout.value
    if row.kind == REQUIRE:
        if r == UNVERIFIED:
            return "unverified", ""
        if r != row.required:
            return "mismatch", f"rollout must be {row.required} ({row.required_source})"
        return "ok", ""
    if row.reject_auto and contract.deterministic and AUTO in (t, r):
        side = "training" if t == AUTO else "rollout"
        return "mismatch", f"{side} kernel is chosen by the engine at run time (unpinned)"
    if UNVERIFIED in (t, r):
        known = r if t == UNVERIFIED else t
        if row.required is not None and known not in (UNVERIFIED, row.required):
            return "mismatch", f"must be {row.required} ({row.required_source})"
        return "unverified", ""
    if t != r:
        return "mismatch", "differs"
    if row.required is not None and t != row.required:
        return "mismatch", f"both sides must be {row.required} ({row.required_source})"
    return "ok", ""


def compare(contract: Contract) -> list[Mismatch]:
    """Every strict/required row that does not hold, with both values and the fix."""
    out: list[Mismatch] = []
    for row in contract.rows:
        state, reason = _check(contract, row)
        if state == "mismatch":
            out.append(
                Mismatch(
                    field=row.field,
                    title=row.title,
                    training=row.training.value,
                    rollout=row.rollout.value,
                    training_source=row.training.source,
                    rollout_source=row.rollout.source,
                    reason=reason,
                    fix=row.fix,
                )
            )
    return out


def format_table(contract: Contract, mismatches: list[Mismatch] | None = None) -> str:
    """Side-by-side table: one line per field, sources below, then notes."""
    if mismatches is None:
        mismatches = compare(contract)
    bad = {m.field for m in mismatches}
    header = (
        f"true-on-policy contract  platform={contract.platform}  deterministic={contract.deterministic}  "
        f"training={contract.training_engine}  rollout={contract.rollout_engine}"
    )
    rows = [("field", "training", "rollout", "status")]
    for row in contract.rows:
        state = status(contract, row)
        mark = {"mismatch": "MISMATCH", "unverified": "unverified", "ok": "ok", "info": "-", "off": "off"}[state]
        if row.field in bad:
            mark = "MISMATCH"
        t = row.training.show() if row.training.display is not None else _fmt(row.training.value)
        r = row.rollout.show() if row.rollout.display is not None else _fmt(row.rollout.value)
        if row.required is not None and state != "info":
            mark += f" (pin {row.required})"
        rows.append((row.title, _clip(t), _clip(r), mark))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [header, "=" * len(header)]
    for i, r in enumerate(rows):
        lines.append(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  ------")
    for row in contract.rows:
        if isinstance(row.training.value, dict) or isinstance(row.rollout.value, dict):
            t = row.training.value if isinstance(row.training.value, dict) else {}
            r = row.rollout.value if isinstance(row.rollout.value, dict) else {}
            lines.append("")
            lines.append(f"{row.title} (training | rollout):")
            for key in sorted(set(t) | set(r)):
                flag = "" if t.get(key) == r.get(key) else "   <-- differs"
                lines.append(f"  {key}: {t.get(key, '<unset>')} | {r.get(key, '<unset>')}{flag}")
    lines.append("")
    lines.append("sources (training | rollout):")
    for row in contract.rows:
        lines.append(f"  {row.title}: {row.training.source} | {row.rollout.source}")
    if contract.notes:
        lines.append("notes:")
        lines += [f"  - {n}" for n in contract.notes]
    if mismatches:
        lines.append(f"{len(mismatches)} mismatch(es):")
        lines += [f"  {m.line()}" for m in mismatches]
    else:
        lines.append("consistent: no mismatch")
    return "\n".join(lines)


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
