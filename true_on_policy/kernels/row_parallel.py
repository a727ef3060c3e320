"""The one row-parallel reduction of every engine: each rank's fp32 subtree, all-gathered, the tree's top levels.

A row-parallel linear's rank holds a contiguous shard of the reduced dim; with the flag on its
:func:`ops.linear` (``k_parts``) is a complete subtree of the unsharded linear's fixed tree, and
:func:`tree_reduce` folds the ranks' subtrees in rank order (:func:`ops.tree_combine`) over an
all-gather -- a copy, so the collective's algorithm cannot change a bit, and never an all-reduce.
The CPU backend (:mod:`.tensor_parallel`) and vLLM (:mod:`true_on_policy.vllm_adapter.linear_layers`) pass
in only their all-gather.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from true_on_policy.kernels import ops

__all__ = ["Gather", "reduce_partials", "tree_reduce", "row_parallel_linear"]

Gather = Callable[[torch.Tensor], list[torch.Tensor]]


def _combine(partial: torch.Tensor, gather: Gather) -> torch.Tensor:
    x32 = partial.to(torch.float32)
    parts = gather(x32)
    return x32.clone() if len(parts) == 1 else ops.tree_combine(parts)


class _Reduce(torch.autograd.Function):
    """Forward: ``reduce(partial)``, the ranks' partials summed; backward: the (replicated) gradient goes
    to every rank's partial unchanged."""

    @staticmethod
    def forward(ctx, partial, reduce):
        return reduce(partial)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def reduce_partials(partial: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``reduce(partial)`` -- a sum over the ranks of their partials -- with the gradient of the sum passed
    to every rank's partial unchanged (every rank computes the same replicated loss from the sum)."""
    if torch.is_grad_enabled() and partial.requires_grad:
        return _Reduce.apply(partial, reduce)
    return reduce(partial)


def tree_reduce(partial: torch.Tensor, gather: Gather) -> torch.Tensor:
    """The sum over ranks of ``partial`` as fp32, the same bits on every rank and at every group size:
    ``gather`` (every rank's tensor in rank order, a copy) of the fp32 partials, then
    :func:`ops.tree_combine` over ranks 0, 1, ..., n-1."""
    return reduce_partials(partial, functools.partial(_combine, gather=gather))


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int,
                        gather: Gather, pack=None) -> torch.Tensor:
    """``x @ weight.T + bias`` of a row-parallel rank (``weight``: its shard of ``parts``), bitwise the
    unsharded :func:`ops.linear`: this rank's fp32 subtree, :func:`tree_reduce`, the bias once and one
    cast (:func:`ops.linear_epilogue`). One part: :func:`ops.linear`. ``pack``: :func:`ops.pack_weight`."""
    if parts == 1:
        return ops.linear(x, weight, bias, pack=pack)
    partial = ops.linear(x, weight, None, torch.float32, k_parts=parts, pack=pack)
    return ops.linear_epilogue(tree_reduce(partial, gather), bias, x.dtype)
