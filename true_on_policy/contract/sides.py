"""Per side: what the training engine and the rollout engine each run, as a :class:`Side`.

Each function takes the typed views of the config (:mod:`true_on_policy.contract.config_views`,
read once, the determinism plan laid over them) and the parsed ``true_on_policy:`` section, and
returns a :class:`Side`: the value and the key (or upstream file) it comes from. Values are
canonical names (:func:`canonical_dtype`, :func:`canonical_attention`) so the two sides compare
directly. Nothing here reads the config.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from true_on_policy.contract import determinism_plan as denv
from true_on_policy.contract.config_reader import parse_bool
from true_on_policy.contract.config_views import A, ENV_PATH, M, MEGATRON, MEGATRON_TC, R, RolloutView, TrainingView

UNVERIFIED = "unverified"  # a side whose value no engine setting determines: never a mismatch, always flagged
AUTO = "auto"  # engine picks at run time: a mismatch when deterministic
NA = "n/a"


@dataclasses.dataclass(frozen=True)
class Side:
    value: Any
    source: str
    display: str | None = None

    def show(self) -> str:
        return str(self.display if self.display is not None else self.value)


def _fmt(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


# --------------------------------------------------------------------------------------------
# canonical names
# --------------------------------------------------------------------------------------------

TOP = "true_on_policy"
ENV = ENV_PATH

# The CPU backend's training-side TP/EP (verl's FSDP engine has no slot for them) and the names of its
# collectives; the same strings as true_on_policy.kernels.tensor_parallel.{ROW_PARALLEL_REDUCTION, MOE_DISPATCH}.
CPU_TP_KEY = f"{TOP}.cpu_tensor_parallel_size"
CPU_EP_KEY = f"{TOP}.cpu_expert_parallel_size"
CPU_ROW_PARALLEL = "all_gather+tree_top"
CPU_MOE_DISPATCH = "replicated"


def _int(value: Any) -> int:
    """An already validated size (an int), or 1 for a side that has none (``UNVERIFIED``, ``n/a``)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


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


# --------------------------------------------------------------------------------------------
# per side
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


def _training_layout(t: TrainingView, settings: Any) -> _Layout:
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
        if settings.platform == "cpu":  # the CPU backend shards the same model code (true_on_policy.kernels.tensor_parallel)
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
    if r.name == "cpu":
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
    kwargs = f"{R}.engine_kwargs.{'sglang' if r.name == 'sglang' else 'vllm'}"
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


def _training_attention(t: TrainingView, settings: Any) -> Side:
    if settings.platform == "cpu" and settings.deterministic and canonical_attention(t.attn_implementation) == "consistent":
        return Side("consistent", f"{TOP}.deterministic=true (project consistent kernels)")
    # kernels=project on a device: the HF model runs the project's attention only where the config
    # names it (attn_implementation=consistent); anything else is read below and compared as it is.
    if t.megatron is not None:
        value = canonical_attention(t.megatron.attention_backend or "flash")
        if settings.platform == "ascend" and t.megatron.flash_attn_npu_batch_invariant:
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


def _rollout_attention(r: RolloutView, settings: Any) -> Side:
    platform = settings.platform
    if denv.project_rollout(r.name, platform, settings.resolved_kernels):
        if settings.deterministic:
            return Side("consistent", f"{R}.name={r.name} + {TOP}.deterministic=true (project kernels)")
        if platform == "cpu":
            return Side(AUTO, f"{R}.name={r.name}")
    if r.name == "sglang":
        return Side(canonical_attention(r.sglang.attention_backend), f"{R}.engine_kwargs.sglang.attention_backend")
    if r.vllm is None:
        return Side(UNVERIFIED, f"{R}.name={r.name}: no attention setting known to this project")
    key = f"{R}.engine_kwargs.vllm.attention_backend"
    explicit = r.vllm.attention_backend
    if platform == "ascend":
        rl = f"{R}.engine_kwargs.vllm.additional_config.rl_config"
        if r.vllm.rl_enabled and r.vllm.rl_training_consistency:
            return Side("flash_attn", f"{rl}.enable_training_consistency ({denv.SOURCES['va_platform']})", "flash_attn_npu_v3")
        if explicit is None:
            return Side(AUTO, f"{rl}.enable_training_consistency unset; vllm-ascend picks its attention backend")
    value = canonical_attention(explicit)
    impl = "vllm_flash_attn (num_splits=1 under batch invariance)" if value == "flash_attn" else value
    return Side(value, key + ("" if explicit else " (unset: vLLM auto-selects)"), impl)


def _rollout_row_parallel(r: RolloutView, platform: str) -> Side:
    tp = r.tp
    if tp <= 1:
        return Side(denv.ROW_PARALLEL_NONE, f"{R}.tensor_model_parallel_size=1")
    if r.name == "cpu":
        return Side(CPU_ROW_PARALLEL, f"{R}.name=cpu, {R}.tensor_model_parallel_size={tp} (true_on_policy.kernels.tensor_parallel)")
    if r.vllm is not None and platform == "ascend":
        key = f"{R}.engine_kwargs.vllm.additional_config.enable_flashcomm1"
        on = r.vllm.flashcomm1 or parse_bool(f"{ENV}.VLLM_ASCEND_ENABLE_FLASHCOMM1", r.env.get("VLLM_ASCEND_ENABLE_FLASHCOMM1"))
        src = f"{ENV}.VLLM_ASCEND_ENABLE_FLASHCOMM1 / {key}"
        return Side(denv.ROW_PARALLEL_RS_AG if on else denv.ROW_PARALLEL_ALL_REDUCE, src)
    if r.vllm is not None:
        src = f"{R}.engine_kwargs.vllm.compilation_config.pass_config.enable_sp"
        return Side(denv.ROW_PARALLEL_RS_AG if r.vllm.sequence_parallel else denv.ROW_PARALLEL_ALL_REDUCE, src)
    return Side(denv.ROW_PARALLEL_ALL_REDUCE, f"{R}.name={r.name} (tensor-parallel all-reduce)")


def _training_dispatcher(t: TrainingView, ep: int, settings: Any) -> Side:
    pin = settings.moe_dispatcher
    if denv.project_kernels(settings.platform, settings.resolved_kernels) and settings.deterministic and t.megatron is None:
        return Side(pin or ("local" if ep <= 1 else CPU_MOE_DISPATCH), f"{TOP}.moe_dispatcher (project kernels)")
    if t.megatron is not None:
        key = f"{MEGATRON_TC}.moe_token_dispatcher_type"
        value = t.megatron.dispatcher
        if ep <= 1:
            return Side("local", f"{MEGATRON}.expert_model_parallel_size=1")
        return Side(str(value or "alltoall"), key + ("" if value else " (verl default alltoall)"))
    if ep <= 1:
        return Side("local", f"{A}.strategy={t.strategy} (experts on every rank)")
    return Side(UNVERIFIED, f"{A}.strategy={t.strategy} (no dispatcher key)")


def _rollout_dispatcher(r: RolloutView, ep: int, settings: Any) -> Side:
    if denv.project_rollout(r.name, settings.platform, settings.resolved_kernels):
        return Side(settings.moe_dispatcher or ("local" if ep <= 1 else CPU_MOE_DISPATCH), f"{TOP}.moe_dispatcher (project kernels)")
    if ep <= 1:
        return Side("local", f"{R}.expert_parallel_size<=1 (experts TP-split, no dispatch)")
    if r.vllm is not None and settings.platform == "ascend":
        return Side(UNVERIFIED, "vllm-ascend selects its MoE communication per batch (no setting)")
    if r.vllm is not None:
        key = f"{R}.engine_kwargs.vllm.all2all_backend"
        backend = r.vllm.all2all_backend or "allgather_reducescatter"
        family = "allgather" if backend in _VLLM_ALLGATHER_BACKENDS else "alltoall"
        return Side(family, key + ("" if r.vllm.all2all_backend else " (vLLM default allgather_reducescatter)"), f"{family} ({backend})")
    return Side(UNVERIFIED, f"{R}.name={r.name} (no dispatcher key)")


def _training_router_dtype(t: TrainingView, compute: str, settings: Any) -> Side:
    pin = settings.moe_router_dtype
    if denv.project_kernels(settings.platform, settings.resolved_kernels) and settings.deterministic and t.megatron is None:
        return Side(canonical_dtype(pin) if pin else compute, f"{TOP}.moe_router_dtype (project kernels)")
    if t.megatron is not None:
        key = f"{MEGATRON_TC}.moe_router_dtype"
        value = t.megatron.router_dtype
        return Side(canonical_dtype(value) if value else compute, key + ("" if value else " (unset: compute dtype)"))
    return Side(compute, f"{A}.strategy={t.strategy} (HF gate runs in the compute dtype)")


def _rollout_router_dtype(r: RolloutView, compute: str, settings: Any) -> Side:
    pin = settings.moe_router_dtype
    if denv.project_rollout(r.name, settings.platform, settings.resolved_kernels):
        return Side(canonical_dtype(pin) if pin else compute, f"{TOP}.moe_router_dtype (project kernels)")
    if r.name == "vllm":
        # vLLM's Qwen3-MoE gate is a ReplicatedLinear with no params_dtype: it runs in the served dtype
        # (vllm-ascend serves the same model class); no engine setting changes it.
        return Side(compute, f"{R}.dtype ({denv.SOURCES['vllm_qwen3_moe']}; no fp32-router setting exists)")
    return Side(UNVERIFIED, f"{R}.name={r.name}: no router-dtype setting (model code decides)")


def _training_batch_invariant(t: TrainingView, settings: Any) -> Side:
    if not settings.deterministic:
        return Side("off", f"{TOP}.deterministic=false")
    if denv.project_kernels(settings.platform, settings.resolved_kernels):
        return Side("on", f"{TOP}.deterministic=true (project consistent kernels)")
    mg = t.megatron
    if settings.platform == "ascend" and mg is not None:
        # GEMMs (use_batch_invariant_ops / batch_invariant_mode) and attention (flash_attn_npu) both
        keys = {
            "use_batch_invariant_ops": mg.batch_invariant_ops,
            "batch_invariant_mode": mg.batch_invariant_mode,
            "use_flash_attn_npu_batch_invariant": mg.flash_attn_npu_batch_invariant,
        }
        off = [k for k, on in keys.items() if not on]
        return Side("off" if off else "on", f"{MEGATRON_TC}.{{{', '.join(keys)}}}" + (f" (off: {', '.join(off)})" if off else ""))
    if mg is not None:
        return Side("on" if mg.batch_invariant_mode else "off", f"{MEGATRON_TC}.batch_invariant_mode")
    return Side(
        UNVERIFIED,
        f"{A}.strategy={t.strategy} on {settings.platform}: verl 0.9.1 has no batch-invariant GEMM switch for training",
    )


def vllm_batch_invariant(env: Mapping[str, str]) -> bool:
    """``VLLM_BATCH_INVARIANT`` in the workers' environment (vLLM's and vllm-ascend's switch)."""
    return parse_bool(f"{ENV}.VLLM_BATCH_INVARIANT", env.get("VLLM_BATCH_INVARIANT"))


def _rollout_batch_invariant(r: RolloutView, settings: Any) -> Side:
    if denv.project_rollout(r.name, settings.platform, settings.resolved_kernels):
        return Side("on" if settings.deterministic else "off", f"{R}.name={r.name} + {TOP}.deterministic (project kernels)")
    rl = f"{R}.engine_kwargs.vllm.additional_config.rl_config"
    rl_on = r.vllm is not None and r.vllm.rl_enabled and r.vllm.rl_batch_invariant
    on = vllm_batch_invariant(r.env) or rl_on
    return Side("on" if on else "off", f"{ENV}.VLLM_BATCH_INVARIANT" + (f" / {rl}.enable_batch_invariant" if settings.platform == "ascend" else ""))


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


def _env_display(env: Mapping[str, str], other: Mapping[str, str]) -> str:
    if not env:
        return "none"
    differing = [k for k in env if other.get(k) != env[k]] + [k for k in other if k not in env]
    if not differing:
        return f"{len(env)} pinned keys (listed below)"
    return ", ".join(f"{k}={env.get(k, '<unset>')}" for k in differing)


def _reduction_env(env: Mapping[str, str], platform: str) -> dict[str, str]:
    return {k: env[k] for k in denv.REDUCTION_ENV_KEYS.get(platform, ()) if k in env}
