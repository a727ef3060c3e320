"""Per-side readers of the contract: what the training engine and the rollout engine each run.

Each reader takes the resolved config (the determinism plan already applied) and returns a
:class:`Side`: the value and the key (or upstream file) it was read from. Values are canonical
names (:func:`canonical_dtype`, :func:`canonical_attention`) so the two sides compare directly.
Reads are strict (:mod:`true_on_policy.contract.config_reader`): a bad value names its key.
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
CPU_ROW_PARALLEL = "all_gather+tree_top"
CPU_MOE_DISPATCH = "replicated"


def _cfg_int(cfg: Any, key: str, default: int = 1) -> int:
    """A parallel size from the config: absent/null = ``default``; anything but an integer >= 1 is an error."""
    return denv.get_int(cfg, key, default)


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
        tp = _cfg_int(cfg, f"{base}.tensor_model_parallel_size")
        ep = _cfg_int(cfg, f"{base}.expert_model_parallel_size")
        etp_raw = _get(cfg, f"{base}.expert_tensor_parallel_size")
        etp = _cfg_int(cfg, f"{base}.expert_tensor_parallel_size", tp)
        pp = _cfg_int(cfg, f"{base}.pipeline_model_parallel_size")
        cp = _cfg_int(cfg, f"{base}.context_parallel_size")
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
        tp = _cfg_int(cfg, f"{base}.tensor_parallel_size")
        ep = _cfg_int(cfg, f"{base}.expert_parallel_size")
        layout = _Layout(
            Side(tp, f"{base}.tensor_parallel_size"),
            Side(ep, f"{base}.expert_parallel_size"),
            Side(UNVERIFIED if ep > 1 else tp, f"{base} (no expert-TP key in verl's torchtitan config)"),
            Side(_cfg_int(cfg, f"{base}.pipeline_parallel_size"), f"{base}.pipeline_parallel_size"),
            Side(_cfg_int(cfg, f"{base}.context_parallel_size"), f"{base}.context_parallel_size"),
            Side(0, ""),
            extra,
        )
    elif strategy == "veomni":
        base = f"{A}.veomni"
        ep = _cfg_int(cfg, f"{base}.expert_parallel_size")
        layout = _Layout(
            Side(1, f"{A}.strategy=veomni (no tensor parallelism)"),
            Side(ep, f"{base}.expert_parallel_size"),
            Side(1, f"{A}.strategy=veomni (experts unsplit)"),
            Side(1, f"{A}.strategy=veomni (no pipeline parallelism)"),
            Side(1, f"{A}.strategy=veomni (no context parallelism)"),
            Side(0, ""),
            extra,
        )
        extra["ulysses"] = Side(_cfg_int(cfg, f"{base}.ulysses_parallel_size"), f"{base}.ulysses_parallel_size")
    else:  # fsdp, fsdp2, fsdp_turbo and any data-parallel engine
        src = f"{A}.strategy={strategy} (FSDP shards parameters, no model parallelism)"
        layout = _Layout(Side(1, src), Side(1, src), Side(1, src), Side(1, src), Side(1, src), Side(0, ""), extra)
        if platform == "cpu":  # the CPU backend shards the same model code (true_on_policy.kernels.tensor_parallel)
            layout.tp = Side(_cfg_int(cfg, CPU_TP_KEY), f"{CPU_TP_KEY} (CPU backend, true_on_policy.kernels.tensor_parallel)")
            layout.ep = Side(_cfg_int(cfg, CPU_EP_KEY), f"{CPU_EP_KEY} (CPU backend, experts whole on their rank)")
        extra["ulysses"] = Side(
            _cfg_int(cfg, f"{A}.fsdp_config.ulysses_sequence_parallel_size"),
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
        tp = _cfg_int(cfg, f"{R}.tensor_model_parallel_size")
        ep = _cfg_int(cfg, f"{R}.expert_parallel_size")
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
    tp = _cfg_int(cfg, f"{R}.tensor_model_parallel_size", 2)
    dp = _cfg_int(cfg, f"{R}.data_parallel_size")
    ep_declared = _cfg_int(cfg, f"{R}.expert_parallel_size")
    ep_on = ep_declared > 1
    ep_src = f"{R}.expert_parallel_size={ep_declared} (EP on => vLLM EP group = TP*DP)"
    if ep_on and ep_declared != tp * dp:
        notes.append(
            f"{R}.expert_parallel_size={ep_declared} but TP*DP={tp * dp}: verl's RolloutConfig rejects this "
            "(verl/workers/config/rollout.py)"
        )
    kwargs = f"{R}.engine_kwargs.{'sglang' if name == 'sglang' else 'vllm'}"
    dcp = _cfg_int(cfg, f"{kwargs}.decode_context_parallel_size")
    pcp = _cfg_int(cfg, f"{kwargs}.prefill_context_parallel_size")
    return _Layout(
        Side(tp, f"{R}.tensor_model_parallel_size"),
        Side(tp * dp if ep_on else 1, ep_src, display=f"{tp * dp if ep_on else 1}"),
        Side(1 if ep_on else tp * dp, f"{R}: experts unsplit under EP, else split TP*DP ways"),
        Side(_cfg_int(cfg, f"{R}.pipeline_model_parallel_size"), f"{R}.pipeline_model_parallel_size"),
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
        on = denv.get_bool(cfg, f"{A}.veomni.mixed_precision", True)
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


def _training_attention(cfg: Any, strategy: str, platform: str, deterministic: bool, kernels: str | None = None) -> Side:
    if platform == "cpu" and deterministic:
        return Side("consistent", f"{TOP}.deterministic=true (project consistent kernels)")
    # kernels=project on a device: the HF model runs the project's attention only where the config
    # names it (attn_implementation=consistent); anything else is read below and compared as it is.
    if strategy == "megatron":
        tc = f"{A}.megatron.override_transformer_config"
        value = canonical_attention(_get(cfg, f"{tc}.attention_backend", "flash"))
        bi = denv.get_bool(cfg, f"{tc}.use_flash_attn_npu_batch_invariant", False)
        if platform == "ascend" and bi:
            return Side("flash_attn", f"{tc}.use_flash_attn_npu_batch_invariant (MindSpeed)", "flash_attn_npu")
        impl = {"flash_attn": "TE flash-attn", "te_fused": "TE fused attention", "eager": "unfused (torch)"}.get(value, value)
        return Side(value, f"{tc}.attention_backend", impl)
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


def _rollout_attention(cfg: Any, name: str, platform: str, deterministic: bool, kernels: str | None = None) -> Side:
    if denv.project_rollout(name, platform, kernels):
        if deterministic:
            return Side("consistent", f"{R}.name={name} + {TOP}.deterministic=true (project kernels)")
        if platform == "cpu":
            return Side(AUTO, f"{R}.name={name}")
    if name == "sglang":
        key = f"{R}.engine_kwargs.sglang.attention_backend"
        return Side(canonical_attention(_get(cfg, key)), key)
    key = f"{R}.engine_kwargs.vllm.attention_backend"
    explicit = _get(cfg, key)
    if platform == "ascend":
        rl = f"{R}.engine_kwargs.vllm.additional_config.rl_config"
        if denv.get_bool(cfg, f"{rl}.enabled", False) and denv.get_bool(cfg, f"{rl}.enable_training_consistency", False):
            return Side("flash_attn", f"{rl}.enable_training_consistency ({denv.SOURCES['va_platform']})", "flash_attn_npu_v3")
        if explicit is None:
            return Side(AUTO, f"{rl}.enable_training_consistency unset; vllm-ascend picks its attention backend")
    value = canonical_attention(explicit)
    impl = "vllm_flash_attn (num_splits=1 under batch invariance)" if value == "flash_attn" else value
    return Side(value, key + ("" if explicit else " (unset: vLLM auto-selects)"), impl)


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
        on = denv.get_bool(cfg, key, False) or denv.parse_bool(f"{ENV}.VLLM_ASCEND_ENABLE_FLASHCOMM1", env.get("VLLM_ASCEND_ENABLE_FLASHCOMM1"))
        src = f"{ENV}.VLLM_ASCEND_ENABLE_FLASHCOMM1 / {key}"
        return Side(denv.ROW_PARALLEL_RS_AG if on else denv.ROW_PARALLEL_ALL_REDUCE, src)
    if name == "vllm":
        comp = _maybe_json(_get(cfg, f"{R}.engine_kwargs.vllm.compilation_config", {})) or {}
        pass_config = comp.get("pass_config", {}) if hasattr(comp, "get") else {}
        pc = f"{R}.engine_kwargs.vllm.compilation_config.pass_config"
        on = denv.parse_bool(f"{pc}.enable_sp", pass_config.get("enable_sp")) or denv.parse_bool(
            f"{pc}.enable_sequence_parallelism", pass_config.get("enable_sequence_parallelism")
        )
        src = f"{R}.engine_kwargs.vllm.compilation_config.pass_config.enable_sp"
        return Side(denv.ROW_PARALLEL_RS_AG if on else denv.ROW_PARALLEL_ALL_REDUCE, src)
    return Side(denv.ROW_PARALLEL_ALL_REDUCE, f"{R}.name={name} (tensor-parallel all-reduce)")


def _training_dispatcher(cfg: Any, strategy: str, ep: int, platform: str, deterministic: bool, pin: Any,
                         kernels: str | None = None) -> Side:
    if denv.project_kernels(platform, kernels) and deterministic and not strategy == "megatron":
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


def _rollout_dispatcher(cfg: Any, name: str, ep: int, platform: str, deterministic: bool, pin: Any,
                        kernels: str | None = None) -> Side:
    if denv.project_rollout(name, platform, kernels):
        return Side(pin or ("local" if ep <= 1 else CPU_MOE_DISPATCH), f"{TOP}.moe_dispatcher (project kernels)")
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


def _training_router_dtype(cfg: Any, strategy: str, compute: str, platform: str, deterministic: bool, pin: Any,
                           kernels: str | None = None) -> Side:
    if denv.project_kernels(platform, kernels) and deterministic and strategy != "megatron":
        return Side(canonical_dtype(pin) if pin else compute, f"{TOP}.moe_router_dtype (project kernels)")
    if strategy == "megatron":
        key = f"{A}.megatron.override_transformer_config.moe_router_dtype"
        value = _get(cfg, key)
        return Side(canonical_dtype(value) if value else compute, key + ("" if value else " (unset: compute dtype)"))
    return Side(compute, f"{A}.strategy={strategy} (HF gate runs in the compute dtype)")


def _rollout_router_dtype(name: str, compute: str, deterministic: bool, pin: Any, platform: str,
                          kernels: str | None = None) -> Side:
    if denv.project_rollout(name, platform, kernels):
        return Side(canonical_dtype(pin) if pin else compute, f"{TOP}.moe_router_dtype (project kernels)")
    if name == "vllm":
        # vLLM's Qwen3-MoE gate is a ReplicatedLinear with no params_dtype: it runs in the served dtype
        # (vllm-ascend serves the same model class); no engine setting changes it.
        return Side(compute, f"{R}.dtype ({denv.SOURCES['vllm_qwen3_moe']}; no fp32-router setting exists)")
    return Side(UNVERIFIED, f"{R}.name={name}: no router-dtype setting (model code decides)")


def _training_batch_invariant(cfg: Any, strategy: str, platform: str, deterministic: bool, kernels: str | None = None) -> Side:
    if not deterministic:
        return Side("off", f"{TOP}.deterministic=false")
    if denv.project_kernels(platform, kernels):
        return Side("on", f"{TOP}.deterministic=true (project consistent kernels)")
    tc = f"{A}.megatron.override_transformer_config"
    if platform == "ascend" and strategy == "megatron":
        # GEMMs (use_batch_invariant_ops / batch_invariant_mode) and attention (flash_attn_npu) both
        keys = ("use_batch_invariant_ops", "batch_invariant_mode", "use_flash_attn_npu_batch_invariant")
        off = [k for k in keys if not denv.get_bool(cfg, f"{tc}.{k}", False)]
        return Side("off" if off else "on", f"{tc}.{{{', '.join(keys)}}}" + (f" (off: {', '.join(off)})" if off else ""))
    if strategy == "megatron":
        on = denv.get_bool(cfg, f"{tc}.batch_invariant_mode", False)
        return Side("on" if on else "off", f"{tc}.batch_invariant_mode")
    return Side(
        UNVERIFIED,
        f"{A}.strategy={strategy} on {platform}: verl 0.9.1 has no batch-invariant GEMM switch for training",
    )


def _rollout_batch_invariant(cfg: Any, name: str, platform: str, deterministic: bool, env: Mapping[str, str],
                             kernels: str | None = None) -> Side:
    if denv.project_rollout(name, platform, kernels):
        return Side("on" if deterministic else "off", f"{R}.name={name} + {TOP}.deterministic (project kernels)")
    rl = f"{R}.engine_kwargs.vllm.additional_config.rl_config"
    rl_on = denv.get_bool(cfg, f"{rl}.enabled", False) and denv.get_bool(cfg, f"{rl}.enable_batch_invariant", False)
    on = denv.parse_bool(f"{ENV}.VLLM_BATCH_INVARIANT", env.get("VLLM_BATCH_INVARIANT")) or rl_on
    return Side("on" if on else "off", f"{ENV}.VLLM_BATCH_INVARIANT" + (f" / {rl}.enable_batch_invariant" if platform == "ascend" else ""))


def _logprobs(cfg: Any, name: str) -> tuple[Side, Side]:
    t = _number(cfg, f"{R}.temperature", 1.0, float)
    training = Side("logprob(softmax(logits/T))", f"{A} log-prob (temperature {R}.temperature={t})")
    if not denv.get_bool(cfg, f"{R}.calculate_log_probs", False):
        return training, Side("not returned", f"{R}.calculate_log_probs=false")
    mode = str(_get(cfg, f"{R}.logprobs_mode", "processed_logprobs") or "processed_logprobs")
    src = f"{R}.logprobs_mode={mode}"
    if mode == "processed_logprobs":
        value = "logprob(softmax(logits/T))"
    elif mode == "raw_logprobs":
        value = "logprob(softmax(logits/T))" if t == 1.0 else "logprob(softmax(logits))"
    else:
        value = mode
    return training, Side(value, src)


def _number(cfg: Any, key: str, default: Any, kind: type) -> Any:
    value = _get(cfg, key, default)
    try:
        if isinstance(value, bool):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise denv.ConfigError(key, value, f"a number ({kind.__name__})") from None


def _sampling(cfg: Any) -> tuple[Side, Side]:
    top_p = _number(cfg, f"{R}.top_p", 1.0, float)
    top_k = _number(cfg, f"{R}.top_k", -1, int)
    full = top_p >= 1.0 and top_k <= 0
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
