"""The rows of log-probs, sampling and determinism: the log-prob definition and sampling support, the
batch-invariant kernels, the reduction-order environment and the engine modes the flag needs.
"""

from __future__ import annotations

from collections.abc import Mapping

from true_on_policy.config.launch import (
    A,
    M,
    MEGATRON_TC,
    R,
    RolloutView,
)
from true_on_policy.config.platforms import CPU, CUDA, Platform, is_vllm
from true_on_policy.contract.determinism_plan import MEGATRON_BI_MODE_UNDER_VERL, REDUCTION_ENV_KEYS
from true_on_policy.contract.names import (
    AUTO,
    ENV,
    NA,
    TOP,
    UNVERIFIED,
)
from true_on_policy.contract.rows import (
    REQUIRE,
    Side,
    Row,
    Context,
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


def logprob_rows(c: Context) -> list[Row]:
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


def _training_batch_invariant(c: Context) -> Side:
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


def _rollout_batch_invariant(c: Context) -> Side:
    r, settings = c.r, c.settings
    if c.project_rollout:
        return Side("on" if settings.deterministic else "off", f"{R}.name={r.name} + {TOP}.deterministic (project kernels)")
    rl = f"{R}.engine_kwargs.vllm.additional_config.rl_config"
    rl_on = r.vllm is not None and r.vllm.rl_enabled and r.vllm.rl_batch_invariant
    on = r.vllm_batch_invariant or rl_on
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


def determinism_rows(c: Context) -> list[Row]:
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
        rows += _vllm_adapter_rows(c)
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


def _vllm_adapter_rows(c: Context) -> list[Row]:
    """What the vLLM adapter refuses when it loads the model (vllm_adapter/patches.py, check_engine_config),
    refused here first, by key: compiled graphs, speculative decoding; on a hybrid (Gated DeltaNet) model a
    platform whose Gated DeltaNet forward the adapter does not replace, prefix caching and a Mamba cache mode
    other than ``none``."""
    vllm = c.r.vllm
    speculative = bool(vllm.speculative_config) or (c.r.mtp_enable and c.r.mtp_enable_rollout)
    rows = [
        Row("eager", "vLLM eager mode", Side(NA, "training runs eagerly"), Side(c.r.enforce_eager, f"{R}.enforce_eager"),
            kind=REQUIRE, required=True, required_source="vLLM adapter (compiled graphs broke bitwise equality)",
            only_when_deterministic=True, fix=f"set {R}.enforce_eager=true"),
        Row("speculative", "vLLM speculative decoding / MTP", Side(NA, "training scores the sampled tokens"),
            Side(speculative, f"{R}.engine_kwargs.vllm.speculative_config / {R}.mtp.enable + enable_rollout"),
            kind=REQUIRE, required=False,
            required_source="vLLM adapter (a draft's verification step is not the consistent forward)",
            only_when_deterministic=True,
            fix=f"remove {R}.engine_kwargs.vllm.speculative_config and set {R}.mtp.enable_rollout=false"),
    ]
    if "linear_attention" not in c.layer_types:
        return rows
    why = "the consistent Gated DeltaNet keeps one recurrent state per request and replays no cached block"
    return rows + [
        _gdn_forward_row(c),
        Row("prefix_caching", "vLLM prefix caching (hybrid model)", Side(NA, "training recomputes every state"),
            Side(c.r.enable_prefix_caching, f"{R}.enable_prefix_caching"), kind=REQUIRE, required=False,
            required_source=why, only_when_deterministic=True, fix=f"set {R}.enable_prefix_caching=false"),
        Row("mamba_cache_mode", "vLLM Mamba cache mode (hybrid model)", Side(NA, "training recomputes every state"),
            Side(vllm.mamba_cache_mode, f"{R}.engine_kwargs.vllm.mamba_cache_mode"), kind=REQUIRE, required="none",
            required_source=why, only_when_deterministic=True, fix=f"set {R}.engine_kwargs.vllm.mamba_cache_mode=none"),
    ]


# The Gated DeltaNet forward the vLLM adapter replaces per platform (vllm_adapter/targets.py, "gdn.forward_<device>").
GDN_FORWARDS = {CPU: "forward_cpu", CUDA: "forward_cuda"}


def _gdn_forward_row(c: Context) -> Row:
    """The rollout's Gated DeltaNet forward: the adapter's on vLLM-CPU (run here) and on CUDA (written, not run on a
    device: unverified until a device run shows it); on Ascend vllm-ascend's own, refused by name."""
    method = GDN_FORWARDS.get(c.platform)
    unverified = ""
    if method is None:
        forward = Side(f"vLLM's own on {c.platform}", "vllm-ascend's Gated DeltaNet: the adapter replaces "
                       f"QwenGatedDeltaNetAttention.{' / '.join(GDN_FORWARDS.values())} only")
    else:
        forward = Side("consistent", f"true_on_policy.vllm_adapter replaces QwenGatedDeltaNetAttention.{method} "
                       "(true_on_policy.kernels.gated_delta)")
    if method is not None and c.platform.device:
        unverified = (f"the adapter's {method} runs the torch code of the Gated DeltaNet op (held torch.equal to the "
                      f"C++ call on CPU): written, not run on a device ({c.platform})")
    return Row("gdn_forward", "vLLM Gated DeltaNet forward (hybrid model)", Side(NA, "training runs the consistent op"),
               forward, kind=REQUIRE, required="consistent", required_source="the adapter replaces the Gated "
               f"DeltaNet forward on {' and '.join(GDN_FORWARDS)} only and refuses the model at load elsewhere "
               "(vllm_adapter/patches.py)", only_when_deterministic=True, unverified=unverified,
               fix=f"run the hybrid model on true_on_policy.platform={' or '.join(GDN_FORWARDS)} (kernels: project), or "
               "with true_on_policy.deterministic=false")
