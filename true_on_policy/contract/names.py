"""The contract's vocabulary: canonical names both sides are written in, so they compare directly.

Values read from either engine's settings are canonical names (:func:`canonical_dtype`,
:func:`canonical_attention`); :data:`UNVERIFIED` marks a side no setting determines, :data:`AUTO` one
the engine picks at run time. Shared by the contract's rows, the kernel families and the CPU rollout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from true_on_policy.config.launch import ENV_PATH, parse_bool

UNVERIFIED = "unverified"  # a side whose value no engine setting determines: never a mismatch, always flagged
AUTO = "auto"  # engine picks at run time: a mismatch when deterministic
NA = "n/a"
TOP = "true_on_policy"
ENV = ENV_PATH

# The CPU backend's training-side TP/EP (verl's FSDP engine has no slot for them); the names of its
# collectives are true_on_policy.kernels.scope's (torch-free).
CPU_TP_KEY = f"{TOP}.cpu_tensor_parallel_size"
CPU_EP_KEY = f"{TOP}.cpu_expert_parallel_size"


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



def vllm_batch_invariant(env: Mapping[str, str]) -> bool:
    """``VLLM_BATCH_INVARIANT`` in the workers' environment (vLLM's and vllm-ascend's switch)."""
    return parse_bool(f"{ENV}.VLLM_BATCH_INVARIANT", env.get("VLLM_BATCH_INVARIANT"))
