"""The layout rows: TP, EP, expert TP, PP, CP, DP, Ulysses per side (where both sides run the project's
TP-invariant kernels, :mod:`~true_on_policy.contract.tp_invariance` relaxes them).
"""

from __future__ import annotations

from true_on_policy.config.launch import (
    A,
    M,
    MEGATRON,
    R,
    RolloutView,
)
from true_on_policy.config.platforms import (
    is_cpu_engine,
    is_sglang,
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
from true_on_policy.kernels.architectures import check_sequence_parallel

# Why CP > 1 is refused under the flag, whichever way it splits (both sides equal is not enough).
CP_NOT_COVERED = (
    "not covered: ring / all-to-all CP (Megatron cp_comm_type p2p, a2a) and vLLM's decode / prefill CP merge "
    "per-rank partial softmaxes (log-sum-exp) in their own order, not the one online softmax of a whole row; "
    "all-gather CP keeps each query row whole, but no run has established its bits; Ulysses SP is covered"
)

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
            required=1 if c.deterministic else None,
            required_source=CP_NOT_COVERED,
            fix=f"set {A}.megatron.context_parallel_size and {R}.engine_kwargs.vllm.decode/prefill_context_parallel_size "
            f"to 1; for long sequences use Ulysses SP ({A}.fsdp_config.ulysses_sequence_parallel_size)",
        ),
        Row("dp", "DP (data parallel)", tl.dp, rl.dp, kind=INFO),
    ]
    for key, side in tl.extra.items():
        title = "Ulysses SP (heads<->sequence all-to-all, no reduction)"
        if c.t.is_fsdp and c.t.attn_implementation == "consistent" and as_size(side.value) > 1:
            rows.append(_consistent_ulysses_row(c, key, title, side))
        else:
            rows.append(Row(key, title, side, Side(NA, "rollout has no Ulysses SP"), kind=INFO))
    return rows


def _consistent_ulysses_row(c: Context, key: str, title: str, side: Side) -> Row:
    """The project's model code all-to-alls over verl's SP group (true_on_policy.kernels.sequence_parallel):
    each rank computes whole heads of the whole sequence, so a token's bits do not depend on SP, where the
    model's heads split by it (and, for Gated DeltaNet layers, the flag is on)."""
    sp = as_size(side.value)
    source = f"{side.source}={sp} vs {M}.path config (true_on_policy.kernels.architectures.check_sequence_parallel)"
    if c.checkpoint is None:
        verdict = UNVERIFIED
        source = f"{source}: {M}.path is not a local checkpoint directory with config.json"
    elif not c.deterministic and "linear_attention" in c.layer_types:
        verdict = (f"{side.source}={sp}: the Gated DeltaNet layers all-to-all on the consistent kernels only "
                   "(true_on_policy.deterministic=true)")
    else:
        try:
            check_sequence_parallel(c.checkpoint.config, sp)
            verdict = "ok"
        except ValueError as error:
            verdict = str(error)
    return Row(key, title, Side(verdict, source, display=f"{sp}: {verdict}"),
               Side("ok", "rollout has no Ulysses SP: a token's bits do not depend on the split"), required="ok",
               required_source="the model's heads split by SP", fix=f"set {side.source} to a size the model's "
               "query and Gated DeltaNet heads divide by (and its KV heads divide or are divided by), or 1")
