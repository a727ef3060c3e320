"""Ulysses sequence parallelism for the consistent kernels: the all-to-all between a rank's slice of the
packed sequence (every head) and the whole sequence of the rank's heads, and back.

The all-to-all moves values and adds nothing, and every kernel run between the two (attention, the Gated
DeltaNet's conv, gating, recurrence and gated norm) computes each head on its own, so a token's bits at
SP n are its bits at SP 1. The projections before and after are per-token linears (row-invariant). The
training engine owns the group: :func:`set_group_source` (verl's Ulysses group, set by its adapter);
None or a group of one rank means no sequence parallelism.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["gather_sequence", "group", "heads_to_sequence", "rank_blocks", "rank_channels", "sequence_to_heads",
           "set_group_source"]

_SOURCE: list[Callable[[], object]] = [lambda: None]


def set_group_source(source: Callable[[], object]) -> None:
    """Where :func:`group` reads the Ulysses process group from (called once by the training adapter)."""
    _SOURCE[0] = source


def group():
    """The current Ulysses group, or None where the sequence is not split (no group, or one rank)."""
    g = _SOURCE[0]()
    if g is None or dist.get_world_size(g) == 1:
        return None
    return g


def _all_to_all(blocks: torch.Tensor, g) -> torch.Tensor:
    """[world, ...] blocks, block r sent to rank r -> [world, ...], block s received from rank s."""
    blocks = blocks.contiguous()
    out = torch.empty_like(blocks)  # contiguous too: all_to_all_single fills it as one buffer
    dist.all_to_all_single(out, blocks, group=g)
    return out


class _Exchange(torch.autograd.Function):
    """One all-to-all direction; its backward is the other (the exchange only moves values)."""

    @staticmethod
    def forward(ctx, x, g, to_heads: bool):
        ctx.g, ctx.to_heads = g, to_heads
        return (_sequence_to_heads if to_heads else _heads_to_sequence)(x, g)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_sequence if ctx.to_heads else _sequence_to_heads)(grad, ctx.g), None, None


def _sequence_to_heads(x, g):
    world = dist.get_world_size(g)
    n, width = x.shape
    blocks = x.reshape(n, world, width // world).transpose(0, 1)  # [world, n, c]: rank r's channels to rank r
    return _all_to_all(blocks, g).reshape(world * n, width // world)


def _heads_to_sequence(y, g):
    world = dist.get_world_size(g)
    length, c = y.shape
    blocks = _all_to_all(y.reshape(world, length // world, c), g)  # [world, n, c]: rank s's heads
    return blocks.transpose(0, 1).reshape(length // world, world * c)


def sequence_to_heads(x: torch.Tensor, g) -> torch.Tensor:
    """[n, world * c] (this rank's n tokens; rank r's channels the r-th block of c) -> [world * n, c]: the
    whole sequence (rank order) of this rank's channels. Differentiable; its backward is the inverse."""
    if x.shape[1] % dist.get_world_size(g):
        raise ValueError(f"true_on_policy: {x.shape[1]} channels do not split over {dist.get_world_size(g)} ranks")
    return _Exchange.apply(x, g, True)


def heads_to_sequence(y: torch.Tensor, g) -> torch.Tensor:
    """The inverse of :func:`sequence_to_heads`: [world * n, c] -> [n, world * c]."""
    return _Exchange.apply(y, g, False)


def gather_sequence(x: torch.Tensor, g) -> torch.Tensor:
    """The ranks' slices of a tensor without gradient (e.g. position ids), joined along the last dim."""
    x = x.contiguous()  # empty_like keeps a view's strides; all_gather fills each part as one buffer
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(g))]
    dist.all_gather(parts, x, group=g)
    return torch.cat(parts, dim=-1)


def rank_channels(x: torch.Tensor, sizes: list[int], world: int, rank: int, dim: int = -1) -> torch.Tensor:
    """Rank ``rank``'s head group of each of ``x``'s parts along ``dim`` (``sizes``, each split into ``world``
    equal groups of whole heads), in part order (e.g. its q | k | v heads of the Gated DeltaNet's conv)."""
    return torch.cat([torch.chunk(p, world, dim=dim)[rank] for p in torch.split(x, sizes, dim=dim)], dim=dim)


def rank_blocks(x: torch.Tensor, sizes: list[int], world: int) -> torch.Tensor:
    """``x``'s channels (last dim) reordered into :func:`sequence_to_heads`' blocks: rank r's
    :func:`rank_channels` r-th."""
    return torch.cat([rank_channels(x, sizes, world, r) for r in range(world)], dim=-1)
