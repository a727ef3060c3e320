"""The canonical names both engines' settings are read into, so the contract's rows compare them directly.

:func:`canonical_dtype` and :func:`canonical_attention` map each engine's spelling (``bf16``,
``torch.bfloat16``; ``flash_attention_2``, ``FLASH_ATTN``, ``AttnBackend.flash``) to one name; the launch
reader (:mod:`true_on_policy.config.launch`) applies them once, when a view is read. :data:`AUTO`: the
engine picks at run time (a mismatch when deterministic). Torch-free.
"""

from __future__ import annotations

from typing import Any

AUTO = "auto"  # engine picks at run time: a mismatch when deterministic


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
