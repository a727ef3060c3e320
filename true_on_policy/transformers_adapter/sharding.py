"""shard_model: a transformers Qwen3 / Qwen3-MoE causal LM sharded in place over TP / EP (CPU, gloo).

Attention and MLP column-/row-parallel by whole heads and columns, experts in contiguous ranges under
EP (no token dispatch), the LM head vocabulary-parallel: the modules of
:mod:`true_on_policy.kernels.tensor_parallel`, which keep the unsharded bits with the flag on. The
sharded model is the same module tree, so it serves the training forward and the rollout. No verl import.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from true_on_policy.kernels.architectures import UnsupportedFeatureError, check_sharding
from true_on_policy.kernels.modules import ConsistentLMHead
from true_on_policy.kernels.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLayout,
    RowParallelLinear,
    VocabParallelLMHead,
    expert_parallel_class,
    layout_of,
)
from true_on_policy.transformers_adapter.forwards import convert_model, is_patched

__all__ = ["shard_model"]


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
            module.__class__ = expert_parallel_class(type(module))
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
