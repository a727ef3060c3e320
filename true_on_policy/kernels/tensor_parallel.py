"""Tensor and expert parallelism for the CPU backend, with the same bits at every TP / EP size.

The sharded modules (column-/row-parallel linears by whole heads and columns, experts in contiguous
ranges under EP with no token dispatch, the vocabulary-parallel LM head) and their collectives over a
``torch.distributed`` group (gloo); :func:`true_on_policy.transformers_adapter.sharding.shard_model`
puts a transformers model on them in place.

With the flag on, every supported size gives the unsharded bits: a row-parallel shard is a
complete subtree of :func:`ops.linear`'s fixed tree, and :func:`tree_all_reduce` all-gathers the
fp32 subtrees and folds the top levels in rank order (never an ``all_reduce``): the one reduction of
:mod:`.row_parallel`; the experts run the one MoE forward of :mod:`.moe`. Gradients are
correct, not bitwise. :func:`check_sharding` refuses an unsupported TP / EP by name. With the flag
off: ``F.linear`` and a plain ``dist.all_reduce``. Pure torch + torch.distributed; no verl import.
Details: docs/parallelism_and_determinism.md.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from true_on_policy.kernels import moe, ops, row_parallel
from true_on_policy.kernels.architectures import check_sharding  # noqa: F401 - its public name here too
from true_on_policy.kernels.modules import ConsistentLinear, ConsistentLMHead, require_silu
from true_on_policy.kernels.scope import MOE_DISPATCH, ROW_PARALLEL_REDUCTION

__all__ = [
    "ROW_PARALLEL_REDUCTION",
    "MOE_DISPATCH",
    "ParallelLayout",
    "all_gather_list",
    "tree_all_reduce",
    "all_gather_last_dim",
    "check_sharding",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelLMHead",
    "expert_parallel_class",
    "layout_of",
]

# ----------------------------------------------------------------------------------------------
# Collectives
# ----------------------------------------------------------------------------------------------


def _world(group) -> int:
    return dist.get_world_size(group)


def all_gather_list(x: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``x``, in rank order (a copy: no arithmetic)."""
    if _world(group) == 1:
        return [x]
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_world(group))]
    dist.all_gather(parts, x, group=group)
    return parts


def _gather(group):
    return functools.partial(all_gather_list, group=group)


def tree_all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """The sum over ranks of ``x`` as fp32, the same bits on every rank and at every group size:
    :func:`row_parallel.tree_reduce` over this group's :func:`all_gather_list`."""
    return row_parallel.tree_reduce(x, _gather(group))


def _plain_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def all_gather_last_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """The ranks' ``x`` concatenated along the last dim in rank order (no reduction)."""
    if _world(group) == 1:
        return x
    return torch.cat(all_gather_list(x, group), dim=-1)


class _CopyToRegion(torch.autograd.Function):
    """Identity forward into a sharded region; backward: the ranks' partial gradients, summed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return tree_all_reduce(grad, ctx.group).to(grad.dtype), None


class _GatherFromRegion(torch.autograd.Function):
    """Forward: all-gather along the last dim; backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.width = group, x.shape[-1]
        return all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        return grad.narrow(-1, rank * ctx.width, ctx.width).contiguous(), None


def _tracks_grad(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def copy_to_region(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToRegion.apply(x, group) if _tracks_grad(x) else x


def plain_reduce_from_region(partial: torch.Tensor, group) -> torch.Tensor:
    """Flag off: the ranks' partials summed by a plain ``dist.all_reduce`` (its own order)."""
    return row_parallel.reduce_partials(partial, functools.partial(_plain_all_reduce, group=group))


def gather_from_region(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherFromRegion.apply(x, group) if _tracks_grad(x) else all_gather_last_dim(x, group)


# ----------------------------------------------------------------------------------------------
# Sharded modules
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How a model was sharded: recorded on it as ``model.true_on_policy_parallel``."""

    tp_size: int
    ep_size: int
    rank: int
    world_size: int
    full_heads: tuple[int, int]  # (query heads, KV heads) of the unsharded model
    group: object = dataclasses.field(default=None, compare=False, repr=False)
    row_parallel_reduction: str = ROW_PARALLEL_REDUCTION


def layout_of(model: nn.Module) -> ParallelLayout | None:
    """The :class:`ParallelLayout` of a sharded model, None for an unsharded one."""
    return getattr(model, "true_on_policy_parallel", None)


class ColumnParallelLinear(ConsistentLinear):
    """Output features split across ranks; the (replicated) input enters the sharded region."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(copy_to_region(x, self.tp_group))


class RowParallelLinear(ConsistentLinear):
    """Input features split across ranks. Flag on: :func:`row_parallel.row_parallel_linear` over this
    group's all-gather -- bitwise the unsharded linear. Flag off: a plain all-reduce of the partial products."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.enabled():
            return row_parallel.row_parallel_linear(x, self.weight, self.bias, _world(self.tp_group),
                                                    _gather(self.tp_group))
        out = plain_reduce_from_region(F.linear(x, self.weight), self.tp_group)
        return out if self.bias is None else out + self.bias


class VocabParallelLMHead(ConsistentLMHead):
    """Vocabulary rows split across ranks; the logit slices are all-gathered in rank order."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(copy_to_region(x, self.tp_group))  # fp32 with the flag on
        return gather_from_region(local, self.tp_group)


def _expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts of all ranks for all tokens (see module doc): flag on, :func:`moe.experts_forward` with
    each slot's row from the rank holding its expert; flag off, local weighted sums and a plain all-reduce."""
    group, lo, n_local = self.ep_group, self.expert_offset, self.num_local_experts
    x = copy_to_region(hidden_states, group)  # a rank's experts see only their pairs: input grads are summed
    if ops.enabled():  # the same checks as the unsharded experts' consistent forward
        require_silu(self)
        moe.check_expert_layout(self)
        owner = top_k_index // n_local  # experts in contiguous ranges

        def select(per_slot):
            return moe.select_owned(per_slot, owner, _gather(group), dist.get_rank(group))

        return moe.experts_forward(x, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                                   experts=range(lo, lo + n_local), select=select)
    weights = copy_to_region(top_k_weights, group)  # each rank's sum holds only its slots' weights
    tokens, top_k = top_k_index.shape
    out = x.new_zeros(tokens, x.shape[-1])
    for expert in range(lo, lo + n_local):
        token, slot = torch.nonzero(top_k_index == expert, as_tuple=True)
        if token.numel():
            gate, up = F.linear(x[token], self.gate_up_proj[expert - lo]).chunk(2, dim=-1)
            rows = F.linear(self.act_fn(gate) * up, self.down_proj[expert - lo])
            out = out.index_add(0, token, rows * weights[token, slot, None].to(rows.dtype))
    return plain_reduce_from_region(out, group).to(hidden_states.dtype)


_EP_CLASSES: dict[type, type] = {}


def expert_parallel_class(cls: type) -> type:
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": _expert_parallel_forward})
    return _EP_CLASSES[cls]
