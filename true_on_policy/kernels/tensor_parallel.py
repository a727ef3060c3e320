"""Tensor and expert parallelism for the CPU backend, with the same bits at every TP / EP size.

:func:`shard_model` shards a transformers Qwen3 / Qwen3-MoE model in place over a
``torch.distributed`` group (gloo): attention and MLP column-/row-parallel by whole heads and
columns, experts in contiguous ranges under EP (no token dispatch), the LM head vocabulary-parallel.
The sharded model is the same module tree, so it serves the training forward and the rollout.

With the flag on, every supported size gives the unsharded bits: a row-parallel shard is a
complete subtree of :func:`ops.linear`'s fixed tree, and :func:`tree_all_reduce` all-gathers the
fp32 subtrees and folds the top levels in rank order (never an ``all_reduce``). Gradients are
correct, not bitwise. :func:`check_sharding` refuses an unsupported TP / EP by name. With the flag
off: ``F.linear`` and a plain ``dist.all_reduce``. Pure torch + torch.distributed (+ the
transformers classes it shards); no verl import. Details: docs/parallelism_and_determinism.md.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from true_on_policy.kernels import architectures
from true_on_policy.kernels import model as cm
from true_on_policy.kernels import ops

__all__ = [
    "ROW_PARALLEL_REDUCTION",
    "MOE_DISPATCH",
    "ParallelLayout",
    "all_gather_list",
    "tree_all_reduce",
    "all_gather_last_dim",
    "select_owned",
    "check_sharding",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelLMHead",
    "shard_model",
    "layout_of",
]

# How the contract names this backend's collectives (true_on_policy.contract.consistency reads the same strings).
ROW_PARALLEL_REDUCTION = "all_gather+tree_top"
MOE_DISPATCH = "replicated"  # EP on CPU: tokens are already on every rank; no dispatch, slot rows selected by owner


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


def tree_all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """The sum over ranks of ``x`` as fp32, the same bits on every rank and at every group size.

    ``all_gather`` of the fp32 partials (a copy: no arithmetic, so the collective's algorithm
    cannot change a bit), then :func:`ops.tree_combine` over the ranks 0, 1, ..., n-1: the top
    levels of the reduction tree whose lower levels each rank computed (:func:`ops.linear`'s ``k_parts``).
    """
    x32 = x.to(torch.float32)
    if _world(group) == 1:
        return x32.clone()
    return ops.tree_combine(all_gather_list(x32, group))


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


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: combine the ranks' partials (the tree's top levels, or a plain all-reduce with the flag
    off); backward: the (replicated) gradient goes to every rank's partial unchanged."""

    @staticmethod
    def forward(ctx, partial, group, ordered):
        return tree_all_reduce(partial, group) if ordered else _plain_all_reduce(partial, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


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


def reduce_from_region(partial: torch.Tensor, group, ordered: bool = True) -> torch.Tensor:
    if _tracks_grad(partial):
        return _ReduceFromRegion.apply(partial, group, ordered)
    return tree_all_reduce(partial, group) if ordered else _plain_all_reduce(partial, group)


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


class ColumnParallelLinear(cm.ConsistentLinear):
    """Output features split across ranks; the (replicated) input enters the sharded region."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(copy_to_region(x, self.tp_group))


class RowParallelLinear(cm.ConsistentLinear):
    """Input features split across ranks. Flag on: each rank's fp32 subtree of the reduction tree
    (:func:`ops.linear` with ``k_parts``), the tree's top levels over the all-gathered subtrees, the
    bias and the cast of :func:`ops.linear_epilogue` -- bitwise the unsharded linear. Flag off: a plain
    all-reduce of the partial products."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.enabled():
            partial = ops.linear(x, self.weight, None, torch.float32, k_parts=_world(self.tp_group))
            out = reduce_from_region(partial, self.tp_group, ordered=True)
            return ops.linear_epilogue(out, self.bias, x.dtype)
        out = reduce_from_region(F.linear(x, self.weight), self.tp_group, ordered=False)
        return out if self.bias is None else out + self.bias


class VocabParallelLMHead(cm.ConsistentLMHead):
    """Vocabulary rows split across ranks; the logit slices are all-gathered in rank order."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(copy_to_region(x, self.tp_group))  # fp32 with the flag on
        return gather_from_region(local, self.tp_group)


class _SelectOwned(torch.autograd.Function):
    """Forward: every rank's per-slot expert rows, gathered, each slot taken from the rank that holds its
    expert (:func:`ops.moe_select`); backward: this rank's rows get the gradient of the slots it owns
    (every rank computes the same replicated loss from the selected rows)."""

    @staticmethod
    def forward(ctx, per_slot, owner, group):
        ctx.save_for_backward(owner)
        ctx.rank = dist.get_rank(group)
        return ops.moe_select(all_gather_list(per_slot, group), owner)

    @staticmethod
    def backward(ctx, grad):
        (owner,) = ctx.saved_tensors
        return torch.where((owner == ctx.rank)[..., None], grad, torch.zeros((), dtype=grad.dtype)), None, None


def select_owned(per_slot: torch.Tensor, owner: torch.Tensor, group) -> torch.Tensor:
    if _tracks_grad(per_slot):
        return _SelectOwned.apply(per_slot, owner, group)
    return ops.moe_select(all_gather_list(per_slot, group), owner)


def _expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts of all ranks for all tokens (see module doc): flag on, each slot's row from the rank
    holding its expert, combined in slot order; flag off, local weighted sums and a plain all-reduce."""
    group, lo, n_local = self.ep_group, self.expert_offset, self.num_local_experts
    x = copy_to_region(hidden_states, group)  # a rank's experts see only their pairs: input grads are summed
    if ops.enabled():  # the same checks as the unsharded experts' consistent forward
        cm._require_silu(self)  # noqa: SLF001
        layout = (("has_bias", False), ("is_transposed", False), ("has_gate", True), ("is_concatenated", True))
        for flag, wanted in layout:
            if getattr(self, flag, wanted) != wanted:
                raise cm.UnsupportedFeatureError(f"true_on_policy: experts with {flag}={not wanted} are not supported")
        experts = range(lo, lo + n_local)
        per_slot = ops.moe_experts(x, top_k_index, self.gate_up_proj, self.down_proj, experts=experts)
        per_slot = select_owned(per_slot, top_k_index // n_local, group)  # experts in contiguous ranges
        return ops.moe_combine(per_slot, top_k_weights).to(hidden_states.dtype)
    weights = copy_to_region(top_k_weights, group)  # each rank's sum holds only its slots' weights
    tokens, top_k = top_k_index.shape
    out = x.new_zeros(tokens, x.shape[-1])
    for expert in range(lo, lo + n_local):
        token, slot = torch.nonzero(top_k_index == expert, as_tuple=True)
        if token.numel():
            gate, up = F.linear(x[token], self.gate_up_proj[expert - lo]).chunk(2, dim=-1)
            rows = F.linear(self.act_fn(gate) * up, self.down_proj[expert - lo])
            out = out.index_add(0, token, rows * weights[token, slot, None].to(rows.dtype))
    return reduce_from_region(out, group, ordered=False).to(hidden_states.dtype)


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


def check_sharding(config, tp_size: int, ep_size: int = 1) -> None:
    """Refuse, naming the key and value, a TP / EP size the consistent kernels do not keep bitwise.

    TP and EP must be powers of two <= :data:`ops.MAX_TP` (the reduction tree's leaves hold whole
    subtrees only up to it); the query and KV head counts, the MLP's intermediate size and, with
    experts split by TP (EP 1), the experts' intermediate size must divide by TP; the experts by EP.
    ``config`` is the model's config (a dict such as config.json, or a transformers config). Checked
    before a model is sharded or an engine starts.
    """
    config = architectures.config_dict(config)
    for name, size in (("tensor_parallel_size", tp_size), ("expert_parallel_size", ep_size)):
        if not isinstance(size, int) or size < 1 or size & (size - 1) or size > ops.MAX_TP:
            raise ValueError(
                f"true_on_policy: {name}={size!r} is not supported: the consistent kernels keep their bits at "
                f"powers of two up to MAX_TP={ops.MAX_TP} (true_on_policy.kernels.ops)"
            )
    experts_key, num_experts = architectures.expert_count(config)
    divisible = [("num_attention_heads", tp_size), ("num_key_value_heads", tp_size), ("intermediate_size", tp_size)]
    if num_experts and ep_size == 1:
        divisible.append(("moe_intermediate_size", tp_size))
    if ep_size > 1:
        if not num_experts:
            raise ValueError(f"true_on_policy: expert_parallel_size={ep_size} for a model without experts")
        divisible.append((experts_key, ep_size))
    for key, size in divisible:
        value = config.get(key)
        if value is not None and value % size:
            what = "expert_parallel_size" if key == experts_key else "tensor_parallel_size"
            raise ValueError(f"true_on_policy: the model's {key}={value} does not divide by {what}={size}")


def shard_model(model: nn.Module, *, tp_size: int, ep_size: int = 1, group=None) -> nn.Module:
    """Shard a Qwen3 / Qwen3-MoE causal LM in place for ``group`` (default: the world group).

    ``tp_size`` and ``ep_size`` must each be 1 or the group's size. Every rank must call it on a
    model with the same (full) weights. The model's config is updated to the LOCAL head counts
    (``num_attention_heads``, ``num_key_value_heads``), which is what sizes the rollout's
    KV caches; the full counts are kept in :func:`layout_of`. Returns the model.
    """
    if not cm.is_patched():
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
        raise cm.UnsupportedFeatureError(f"shard_model: {type(model).__name__} is not a Qwen3 / Qwen3-MoE causal LM")
    config = model.config
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // hq
    cm.convert_model(model)  # plain nn.Linear -> ConsistentLinear (idempotent)
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
        if not isinstance(head, cm.ConsistentLMHead):
            raise cm.UnsupportedFeatureError(f"shard_model: lm_head is a {type(head).__name__}")
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
