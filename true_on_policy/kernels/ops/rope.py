"""RoPE: one fp32 cos/sin table per model, indexed by absolute position by both engines.

:func:`rope_table` (HF's frequencies: default, ``linear``, ``llama3``; partial RoPE), :func:`apply_rope`
(elementwise fp32, cast once) and :func:`text_positions` (mRoPE's rows of text tokens, 1-D).
"""

from __future__ import annotations

import math

import torch

from true_on_policy.kernels import architectures

def rope_table(config, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` [max_position_embeddings, :func:`architectures.rotary_dim`], computed once per model.

    Invariant: both engines index the SAME table by absolute position, so a position's rotation
    never depends on which other positions were computed with it (torch's ``cos``/``sin`` kernels
    are not guaranteed position-invariant). ``config``: a model config (mapping or transformers
    config). The frequencies are HF's: default RoPE, ``linear`` scaling (divided by its factor) or
    Llama-3's ``llama3`` scaling; any other rope type raises. Partial RoPE (Qwen3.5): the frequencies
    of ``rotary_dim`` features, as transformers' ``compute_default_rope_parameters``.
    Bits: rest on vml_sincos and aten_pow (the frequencies).
    """
    config = architectures.config_dict(config)
    params = architectures.rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise NotImplementedError(f"consistent ops: rope type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
    base = float(params["rope_theta"])
    try:
        dim = architectures.rotary_dim(config)
    except ValueError as error:
        raise NotImplementedError(f"consistent ops: {error}") from None
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float32) / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    positions = torch.arange(config["max_position_embeddings"], dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def text_positions(positions: torch.Tensor) -> torch.Tensor:
    """The 1-D positions of multimodal RoPE's position rows ``(3, ...)`` (temporal, height, width) for
    text: interleaved mRoPE of three equal rows is 1-D RoPE, so the first row. Rows that differ (image
    or video tokens) are refused: the consistent RoPE is 1-D."""
    if positions.dim() < 2 or positions.shape[0] != 3:
        raise ValueError(f"text_positions: expected mRoPE position rows (3, ...), got {tuple(positions.shape)}")
    if not (torch.equal(positions[0], positions[1]) and torch.equal(positions[0], positions[2])):
        raise NotImplementedError("consistent ops: multimodal RoPE with position rows that differ (image or video "
                                  "tokens) is not supported; text tokens only")
    return positions[0]


ROPE_TYPES = ("default", "linear", "llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1's frequency scaling, as transformers' ``_compute_llama3_parameters`` computes it."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in fp32, cast once to ``x``'s dtype.

    Invariant: elementwise, correctly rounded ops on fp32 values; ``cos``/``sin`` are rows of
    :func:`rope_table` (already broadcast by position), unsqueezed at ``unsqueeze_dim`` as HF does.
    Partial RoPE: only the first ``cos.shape[-1]`` features of a head rotate, the rest pass through
    unchanged (transformers' Qwen3.5 ``apply_rotary_pos_emb``).
    Bits: the project's order.
    """
    c = cos.to(torch.float32).unsqueeze(unsqueeze_dim)
    s = sin.to(torch.float32).unsqueeze(unsqueeze_dim)
    rotated = c.shape[-1]
    if rotated == x.shape[-1]:
        h = x.to(torch.float32)
        return (h * c + _rotate_half(h) * s).to(x.dtype)
    h = x[..., :rotated].to(torch.float32)
    return torch.cat(((h * c + _rotate_half(h) * s).to(x.dtype), x[..., rotated:]), dim=-1)
