"""The rows of what each side computes in: model, dtypes, attention backend, and the GEMM / RMSNorm /
log-softmax kernel families (:mod:`true_on_policy.contract.kernel_families`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from true_on_policy.config.launch import (
    A,
    M,
    MEGATRON,
    MEGATRON_TC,
    R,
    TrainingView,
    VllmView,
)
from true_on_policy.config.platforms import Platform, is_sglang
from true_on_policy.config.settings import Settings
from true_on_policy.contract import kernel_families
from true_on_policy.contract.determinism_plan import SOURCES
from true_on_policy.contract.names import (
    AUTO,
    NA,
    TOP,
    UNVERIFIED,
    canonical_attention,
)
from true_on_policy.contract.rows import (
    INFO,
    REQUIRE,
    Side,
    Row,
    Context,
)
from true_on_policy.kernels.scope import KERNEL_DTYPES

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


def model_rows(c: Context) -> list[Row]:
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


def _training_master_dtype(t: TrainingView) -> Side:
    if t.fsdp is not None and t.strategy.startswith("fsdp"):
        return Side(t.fsdp.model_dtype, f"{A}.fsdp_config.model_dtype")
    if t.megatron is not None:
        return Side("float32", f"{MEGATRON}.use_distributed_optimizer (fp32 main params)")
    return Side("float32", f"{A}.strategy={t.strategy} (optimizer keeps fp32 weights)")




def dtype_rows(c: Context) -> list[Row]:
    t_compute = Side(*c.t.compute_dtype)
    r_dtype = c.r.dtype
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
    if c.r.vllm is not None and "linear_attention" in c.layer_types:
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
    if settings.platform.cpu_backend and settings.deterministic and t.attn_implementation == "consistent":
        return Side("consistent", f"{TOP}.deterministic=true (project consistent kernels)")
    # kernels=project on a device: the HF model runs the project's attention only where the config
    # names it (attn_implementation=consistent); anything else is read below and compared as it is.
    if t.megatron is not None:
        value = t.megatron.attention_backend or "flash_attn"  # verl's default: flash
        if settings.platform.npu and t.megatron.flash_attn_npu_batch_invariant:
            return Side("flash_attn", f"{MEGATRON_TC}.use_flash_attn_npu_batch_invariant (MindSpeed)", "flash_attn_npu")
        impl = {"flash_attn": "TE flash-attn", "te_fused": "TE fused attention", "eager": "unfused (torch)"}.get(value, value)
        return Side(value, f"{MEGATRON_TC}.attention_backend", impl)
    if t.torchtitan is not None:
        return Side(t.torchtitan.attn_type, f"{A}.torchtitan.attn_type")
    if t.veomni is not None:
        return Side(t.veomni.attn_implementation, f"{A}.veomni.attn_implementation")
    impl = t.attn_implementation
    return Side(
        impl or "flash_attn",
        f"{M}.override_config.attn_implementation" + ("" if impl else " (verl default flash_attention_2)"),
    )


def _rollout_attention(c: Context) -> Side:
    r, settings, platform = c.r, c.settings, c.platform
    if c.project_rollout:
        if settings.deterministic:
            return Side("consistent", f"{R}.name={r.name} + {TOP}.deterministic=true (project kernels)")
        if platform.cpu_backend:
            return Side(AUTO, f"{R}.name={r.name}")
    if is_sglang(r.name):
        return Side(r.sglang.attention_backend or AUTO, f"{R}.engine_kwargs.sglang.attention_backend")
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
    value = explicit or AUTO
    impl = "vllm_flash_attn (num_splits=1 under batch invariance)" if value == "flash_attn" else value
    return Side(value, key + ("" if explicit else " (unset: vLLM auto-selects)"), impl)


def _attention_unverified(platform: Platform, training_impl: str, rollout_impl: str) -> str:
    """Why two attention sides of the same family still cannot count as verified on a device stack."""
    if platform.cpu_backend:
        return ""
    if training_impl == rollout_impl == "consistent":
        return f"the project's attention (true_on_policy.kernels.ops.attention) on both sides: written, not run on a device ({platform})"
    if {training_impl, rollout_impl} == {"flash_attn_npu", "flash_attn_npu_v3"}:
        return (
            "training flash_attn_npu (MindSpeed batch-invariant) vs rollout flash_attn_npu_v3 (vllm-ascend FA3): "
            "two packages; that they run the same kernel with the same KV split is not established"
        )
    return f"training {training_impl} vs rollout {rollout_impl}: same family, bitwise equality not established on {platform}"


def attention_row(c: Context) -> Row:
    t = _training_attention(c.t, c.settings)
    r = _rollout_attention(c)
    unverified = ""
    if t.value == r.value and AUTO not in (t.value, r.value):
        unverified = _attention_unverified(c.platform, t.show(), r.show())
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


def kernel_rows(c: Context) -> list[Row]:
    """GEMM / RMSNorm / log-softmax implementation per side (true_on_policy.contract.kernel_families)."""
    rows = []
    for fam in kernel_families.families(
        c.t,
        c.r,
        platform=c.platform,
        versions=c.plan.versions.effective,
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
