"""The training/rollout consistency contract: its rows, each next to the readers of its two sides.

Bitwise-equal log-probs need the same arithmetic on both engines: parallel layout, dtypes,
attention kernel, MoE dispatch/combine and row-parallel reduction, log-prob definition and sampling
support, determinism environment. :func:`build_contract` takes each, per side, from the views of the
two sides (:mod:`true_on_policy.config.launch`, the determinism plan laid over them) and the parsed
``true_on_policy:`` pins: each row is specified once, after the functions that read its training
and rollout :class:`Side` (the value and the key, or upstream file, it comes from), in the module of
its family (:mod:`~true_on_policy.contract.layout_rows`, :mod:`~true_on_policy.contract.kernel_rows`,
:mod:`~true_on_policy.contract.reduction_rows`, :mod:`~true_on_policy.contract.determinism_rows`; the
row model and the table: :mod:`~true_on_policy.contract.rows`). A row's
:class:`Status` is decided once, when the contract is built; :func:`compare` lists the mismatches with
their fixes, :func:`unverified` what cannot be verified, :func:`format_table` prints both sides. A side
no setting determines reads ``unverified`` (refused unless accepted), never a mismatch.

Pure: no verl, no omegaconf import; nothing here reads the config. Each field, its kind and the
keys it is read from on each engine: docs/parallelism_and_determinism.md ("Contract fields").
"""

from __future__ import annotations

from true_on_policy.config.launch import Sides
from true_on_policy.config.platforms import is_cpu_engine, is_vllm
from true_on_policy.config.settings import Settings
from true_on_policy.contract.determinism_plan import Plan
from true_on_policy.contract.determinism_rows import determinism_rows, logprob_rows
from true_on_policy.contract.kernel_rows import attention_row, dtype_rows, kernel_rows, model_rows
from true_on_policy.contract.layout_rows import layout_rows, rollout_layout, training_layout
from true_on_policy.contract.reduction_rows import moe_rows, row_parallel_row
from true_on_policy.contract.rows import (  # the row model, re-exported: the contract's public names
    INFO,
    REQUIRE,
    STRICT,
    Context,
    Contract,
    Mismatch,
    Row,
    Side,
    Status,
    as_size,
    compare,
    format_table,
    judged,
    unverified,
)
from true_on_policy.contract.tp_invariance import tp_invariant_rows
from true_on_policy.kernels.architectures import Checkpoint

__all__ = [
    "INFO", "REQUIRE", "STRICT", "Contract", "Mismatch", "Row", "Side", "Status", "build_contract", "compare",
    "format_table", "judged", "unverified",
]


def build_contract(settings: Settings, sides: Sides, plan: Plan, checkpoint: Checkpoint | None = None) -> Contract:
    """The two-column contract of the views ``sides`` under ``settings`` (platform resolved);
    ``checkpoint`` is the model's config.json as the launch reader judged it (None: not a local
    checkpoint directory).

    The plan's config updates are laid over the views first (:meth:`Sides.overlay`), so the contract
    describes what the launch will run with; each row's status is decided here. Nothing here reads the
    config or the checkpoint.
    """
    ctx = _context(sides, settings, plan, checkpoint)
    rows = [
        *layout_rows(ctx),
        *dtype_rows(ctx),
        *model_rows(ctx),
        attention_row(ctx),
        *kernel_rows(ctx),
        row_parallel_row(ctx),
        *moe_rows(ctx),
        *logprob_rows(ctx),
        *determinism_rows(ctx),
    ]
    rows = tp_invariant_rows(ctx, rows)
    return Contract(
        platform=ctx.platform,
        deterministic=ctx.deterministic,
        training_engine=ctx.strategy,
        rollout_engine=ctx.name,
        rows=tuple(judged(row, ctx.deterministic) for row in rows),
        notes=tuple(dict.fromkeys(ctx.notes)),
        plan=plan,
    )


def _context(sides: Sides, settings: Settings, plan: Plan, checkpoint: Checkpoint | None) -> Context:
    applied = sides.overlay(plan.config_updates)
    t, r = applied.training, applied.rollout
    project = settings.resolved_kernels == "project"  # always on cpu: Settings refuses kernels=engine there
    c = Context(
        t, r, settings, plan, list(plan.notes) + [f"not emitted: {s}" for s in plan.skipped], checkpoint,
        platform=settings.platform, deterministic=settings.deterministic, project=project,
        project_rollout=is_cpu_engine(r.name) or (is_vllm(r.name) and project), strategy=t.strategy, name=r.name,
    )
    c.layer_types = checkpoint.layer_types if checkpoint is not None else ()
    c.tl = training_layout(c)
    c.rl = rollout_layout(r, c.notes)
    cpu_sides = [s for s, on in ((c.tl, c.platform.cpu_backend), (c.rl, is_cpu_engine(r.name))) if on]
    if any(as_size(side.tp.value) > 1 or as_size(side.ep.value) > 1 for side in cpu_sides):
        c.notes.append(
            "CPU TP/EP > 1 is true_on_policy.transformers_adapter.sharding.shard_model (gloo, all-gather + the reduction tree's top levels), "
            "proven at library level (tests/unit/test_tensor_parallel.py); verl's FSDP trainer and the Ray-served cpu "
            "rollout replica do not shard yet"
        )
    engine_bi = is_vllm(r.name) and r.vllm_batch_invariant
    c.rollout_env = {**r.env, **(plan.rollout_forced_env if engine_bi else {})}
    return c
