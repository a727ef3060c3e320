"""RMSNorm (Qwen3's and Qwen3.5's unit-offset one), with the sum of squares a :func:`.elementwise.fixed_sum`.

A row's result depends on the row and the weight alone; the casts are exactly transformers'.
"""

from __future__ import annotations

import torch

from true_on_policy.kernels.ops.dispatch import _inference, _route
from true_on_policy.kernels.ops.elementwise import fixed_sum

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False) -> torch.Tensor:
    """Qwen3RMSNorm: ``weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype)``, fp32 inside.

    Invariant: the sum of squares is :func:`fixed_sum` (fixed tree) and HF's ``x * rsqrt(v)``
    is ``x / sqrt(v)`` (div is correctly rounded, torch's fp32 sqrt measured position-invariant;
    torch's rsqrt kernel is not position-invariant in bf16). The casts are exactly HF's: fp32
    inside, back to the input dtype before the weight multiply (whose dtype promotion is HF's too).

    ``unit_offset``: Qwen3.5's RMSNorm (Gemma's): the normalized fp32 row times ``1.0 + weight.float()``
    in fp32, then one cast to ``x``'s dtype (the same normalization; only the weight step differs).
    Bits: rest on vml_sqrt (torch's sqrt, which the native route calls too).
    """
    if (kernel := _route("rms_norm", x.device, x, weight, unit_offset)).run:
        return kernel.run(x, weight, eps)
    input_dtype = x.dtype
    h = x.to(torch.float32)
    if unit_offset:
        normed = h / torch.sqrt(fixed_sum(h * h) / h.shape[-1] + eps)
        return (normed * (1.0 + weight.to(torch.float32))).to(input_dtype)
    if not _inference(x, weight):
        variance = fixed_sum(h * h) / h.shape[-1]
        return weight * (h / torch.sqrt(variance + eps)).to(input_dtype)
    # inference: the same ops, in place on the fresh intermediates
    root = fixed_sum(h * h).div_(h.shape[-1]).add_(eps).sqrt_()
    return weight * torch.div(h, root).to(input_dtype)
