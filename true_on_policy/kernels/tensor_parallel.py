"""Tensor and expert parallelism for the CPU backend, with the same bits at every TP / EP size.

:func:`shard_model` shards a transformers Qwen3 / Qwen3-MoE model in place over a
``torch.distributed`` group (gloo): attention and MLP column-/row-parallel by whole heads and
columns, experts in contiguous ranges under EP (no token dispatch), the LM head vocabulary-parallel.
The sharded model is the same module tree, so it serves the training forward and the rollout.

With the flag on, every supported size gives the unsharded bits: a row-parallel shard is a
complete subtree of :func:`ops.linear`'s fixed tree, and :func:`tree_all_reduce` all-gathers the
fp32 subtrees and folds the top levels in rank order (never an ``all_reduce``): the one reduction of
:mod:`.row_parallel`; the experts run the one MoE forward of :mod:`.moe`. Gradients are
correct, not bitwise. :func:`check_sharding` refuses an unsupported TP / EP by name. With the flag
off: ``F.linear`` and a plain ``dist.all_reduce``. Pure torch + torch.distributed (+ the
transformers classes it shards); no verl import. Details: docs/parallelism_and_determinism.md.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from true_on_policy.kernels import moe, ops, row_parallel
from true_on_policy.kernels.architectures import UnsupportedFeatureError, check_sharding  # noqa: F401 - its public name here too
from true_on_policy.kernels.model import ConsistentLinear, ConsistentLMHead, convert_model, is_patched, require_silu
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
    "shard_model",
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


def _expert_parallel_class(cls: type) -> type:
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": _expert_parallel_forward})
    return _EP_CLASSES[cls]


# ----------------------------------------------------------------------------------------------
# shard_model
# ----------------------------------------------------------------------------------------------


def _classes():
    from transformers.models.qwen3 import modeling_qwen3 as q3
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q3m

    return (
        (q3.Qwen3Attention, q3m.Qwen3MoeAttention),
        (q3.Qwen3MLP, q3m.Qwen3MoeMLP),
        (q3m.Qwen3MoeExperts,),
        (q3.Qwen3ForCausalLM, q3m.Qwen3MoeForCausalLM),
    )


def _slice_param(param: nn.Parameter, dim: int, index: int, parts: int) -> nn.Parameter:
    size = param.shape[dim]
    if size % parts:
        raise ValueError(f"shard_model: dimension {dim} of size {size} does not split into {parts} parts")
    width = size // parts
    return nn.Parameter(param.detach().narrow(dim, index * width, width).clone(), requires_grad=param.requires_grad)


def _column(linear: nn.Linear, group, rank: int, parts: int) -> None:
    """Keep output rows [rank*n/parts, (rank+1)*n/parts)."""
    linear.weight = _slice_param(linear.weight, 0, rank, parts)
    if linear.bias is not None:
        linear.bias = _slice_param(linear.bias, 0, rank, parts)
    linear.out_features = linear.weight.shape[0]
    linear.__class__ = ColumnParallelLinear
    linear.tp_group = group


def _row(linear: nn.Linear, group, rank: int, parts: int) -> None:
    """Keep input columns [rank*k/parts, (rank+1)*k/parts); the bias stays whole (added once)."""
    linear.weight = _slice_param(linear.weight, 1, rank, parts)
    linear.in_features = linear.weight.shape[1]
    linear.__class__ = RowParallelLinear
    linear.tp_group = group


def shard_model(model: nn.Module, *, tp_size: int, ep_size: int = 1, group=None) -> nn.Module:
    """Shard a Qwen3 / Qwen3-MoE causal LM in place for ``group`` (default: the world group).

    ``tp_size`` and ``ep_size`` must each be 1 or the group's size. Every rank must call it on a
    model with the same (full) weights. The model's config is updated to the LOCAL head counts
    (``num_attention_heads``, ``num_key_value_heads``), which is what sizes the rollout's
    KV caches; the full counts are kept in :func:`layout_of`. Returns the model.
    """
    if not is_patched():
        raise RuntimeError("shard_model: call consistent_model.patch_transformers() first")
    if layout_of(model) is not None:
        raise RuntimeError(f"shard_model: the model is already sharded ({layout_of(model)})")
    if not dist.is_initialized():
        raise RuntimeError("shard_model: torch.distributed is not initialised")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, size in (("tp_size", tp_size), ("ep_size", ep_size)):
        if size not in (1, world):
            raise ValueError(f"shard_model: {name}={size}; it must be 1 or the group size {world}")
    check_sharding(model.config, tp_size, ep_size)
    attention_classes, mlp_classes, expert_classes, lm_classes = _classes()
    if not isinstance(model, lm_classes):
        raise UnsupportedFeatureError(f"shard_model: {type(model).__name__} is not a Qwen3 / Qwen3-MoE causal LM")
    config = model.config
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // hq
    convert_model(model)  # plain nn.Linear -> ConsistentLinear (idempotent)
    for module in list(model.modules()):
        if tp_size > 1 and isinstance(module, attention_classes):
            # column blocks of q/k/v are whole heads: rank r owns heads [r*H/tp, (r+1)*H/tp)
            for name in ("q_proj", "k_proj", "v_proj"):
                _column(getattr(module, name), group, rank, tp_size)
            _row(module.o_proj, group, rank, tp_size)
        elif tp_size > 1 and isinstance(module, mlp_classes):
            _column(module.gate_proj, group, rank, tp_size)
            _column(module.up_proj, group, rank, tp_size)
            _row(module.down_proj, group, rank, tp_size)
        elif ep_size > 1 and isinstance(module, expert_classes):
            n_local = module.num_experts // ep_size
            module.gate_up_proj = _slice_param(module.gate_up_proj, 0, rank, ep_size)
            module.down_proj = _slice_param(module.down_proj, 0, rank, ep_size)
            module.__class__ = _expert_parallel_class(type(module))
            module.ep_group, module.expert_offset, module.num_local_experts = group, rank * n_local, n_local
    if tp_size > 1:
        head = model.lm_head
        if not isinstance(head, ConsistentLMHead):
            raise UnsupportedFeatureError(f"shard_model: lm_head is a {type(head).__name__}")
        head.weight = _slice_param(head.weight, 0, rank, tp_size)  # unties a tied head: the embedding stays whole
        if head.bias is not None:
            head.bias = _slice_param(head.bias, 0, rank, tp_size)
        head.out_features = head.weight.shape[0]
        head.__class__ = VocabParallelLMHead
        head.tp_group = group
        config.head_dim = head_dim  # pin it before the head counts change
        config.num_attention_heads = hq // tp_size
        config.num_key_value_heads = hkv // tp_size
    model.true_on_policy_parallel = ParallelLayout(tp_size, ep_size, rank, world, (hq, hkv), group)
    return model
