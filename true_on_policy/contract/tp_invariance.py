"""The TP-invariant sharding rule: where both sides run the project's TP-invariant kernels, the layout
rows hold for any power-of-two TP / EP, and the model's shapes must divide by each side's (torch-free).
"""

from __future__ import annotations

import dataclasses

from true_on_policy.config.launch import ROW_PARALLEL_NONE, M
from true_on_policy.config.platforms import is_fsdp, is_vllm
from true_on_policy.contract.names import UNVERIFIED
from true_on_policy.contract.rows import Context, Row, Side, as_size
from true_on_policy.kernels.architectures import check_sharding
from true_on_policy.kernels.scope import MAX_TP, MOE_DISPATCH, ROW_PARALLEL_REDUCTION

TP_INVARIANT = "TP-invariant"
TP_INVARIANT_FIELDS = ("tp", "ep", "etp", "row_parallel", "moe_dispatcher")


def tp_invariant_rows(c: Context, rows: list[Row]) -> list[Row]:
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
        if row.field == "row_parallel" and is_vllm(c.name) and as_size(c.rl.tp.value) > 1:
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


def _sharding_row(c: Context) -> Row:
    """Each side's TP / EP against the model's shapes (its config.json), read only where a side shards."""
    sides = []
    for layout, who in ((c.tl, "training"), (c.rl, "rollout")):
        tp, ep = as_size(layout.tp.value), as_size(layout.ep.value)
        source = f"{M}.path config vs {who} TP {tp} / EP {ep} (true_on_policy.kernels.tensor_parallel.check_sharding)"
        if max(tp, ep) <= 1:
            sides.append(Side("ok", f"{who} unsharded"))
            continue
        if c.checkpoint is None:
            sides.append(Side(UNVERIFIED, f"{source}: {M}.path is not a local checkpoint directory with config.json"))
            continue
        try:
            check_sharding(c.checkpoint.config, tp, ep)
            sides.append(Side("ok", source))
        except ValueError as error:
            sides.append(Side(str(error), source))
    return Row(
        "sharding", "TP / EP for the model's shapes", sides[0], sides[1], required="ok", required_source="the model's shapes",
        fix="pick TP / EP sizes the model's head counts, intermediate sizes and experts divide by",
    )
