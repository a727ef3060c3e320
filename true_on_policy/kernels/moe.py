"""The one MoE forward of every engine: fp32 router, stable top-k, per-expert consistent linears, slot-order combine.

The training model's patched router and experts (:mod:`true_on_policy.transformers_adapter.forwards`), expert parallelism on CPU
(:mod:`.tensor_parallel`) and vLLM's MoE block (:mod:`true_on_policy.vllm_adapter.moe_block`) call these
functions; an adapter passes in only its collectives: ``gather`` (every rank's tensor in rank order,
a copy) and its rank. So the expert arithmetic, the expert layout read and the sharded selection
cannot drift between the engines.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from true_on_policy.kernels import ops
from true_on_policy.kernels.architectures import UnsupportedFeatureError
from true_on_policy.kernels.row_parallel import Gather

__all__ = ["EXPERT_LAYOUT", "check_expert_layout", "route", "select_owned", "experts_forward", "shared_expert"]

# The transformers experts' layout the consistent experts read: gate_up_proj [E, 2I, H] (gate rows
# first), down_proj [E, H, I], no bias. (attribute, the value read; a module without it has that value)
EXPERT_LAYOUT = (("has_bias", False), ("is_transposed", False), ("has_gate", True), ("is_concatenated", True))


def check_expert_layout(experts) -> None:
    """Refuse, naming the attribute, a transformers experts module laid out otherwise than :data:`EXPERT_LAYOUT`."""
    for flag, wanted in EXPERT_LAYOUT:
        if getattr(experts, flag, wanted) != wanted:
            raise UnsupportedFeatureError(f"true_on_policy: experts with {flag}={not wanted} are not supported")


def route(hidden: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool, pack=None):
    """fp32 router logits (:func:`ops.linear`) and their stable top-k (:func:`ops.moe_route`):
    ``(logits [T, E], weights fp32 [T, k], expert ids [T, k])``. ``pack``: the router weight's
    :func:`ops.pack_weight` (an inference engine's), the same bits. Qwen3-MoE renormalizes as its
    ``norm_topk_prob`` says; Qwen3.5-MoE's router (``Qwen3_5MoeTopKRouter``: softmax, top-k) always does."""
    logits = ops.linear(hidden, router_weight, out_dtype=torch.float32, pack=pack)
    weights, experts = ops.moe_route(logits, top_k, renormalize)
    return logits, weights, experts


class _SelectOwned(torch.autograd.Function):
    """Forward: :func:`ops.moe_select` over every rank's per-slot rows; backward: this rank's rows get the
    gradient of the slots it owns (every rank computes the same replicated loss from the selected rows)."""

    @staticmethod
    def forward(ctx, per_slot, owner, gather, rank):
        ctx.save_for_backward(owner)
        ctx.rank = rank
        return ops.moe_select(gather(per_slot), owner)

    @staticmethod
    def backward(ctx, grad):
        (owner,) = ctx.saved_tensors
        kept = torch.where((owner == ctx.rank)[..., None], grad, torch.zeros((), dtype=grad.dtype))
        return kept, None, None, None


def select_owned(per_slot: torch.Tensor, owner: torch.Tensor, gather: Gather, rank: int) -> torch.Tensor:
    """Expert parallelism: slot (t, s) taken from rank ``owner[t, s]``'s rows, gathered (a selection, no
    arithmetic: the unsharded experts' bits)."""
    if torch.is_grad_enabled() and per_slot.requires_grad:
        return _SelectOwned.apply(per_slot, owner, gather, rank)
    return ops.moe_select(gather(per_slot), owner)


def experts_forward(hidden, top_k_index, top_k_weights, gate_up, down, *, packs=None, experts=None,
                    select: Callable[[torch.Tensor], torch.Tensor] | None = None, k_parts: int = 1,
                    gather: Gather | None = None) -> torch.Tensor:
    """Every token through its top-k experts (:func:`ops.moe_experts`), combined in slot order
    (:func:`ops.moe_combine`), cast to ``hidden``'s dtype: [T, H].

    Unsharded: ``gate_up``/``down`` hold every expert. Expert parallelism: ``experts`` the global ids
    they hold and ``select(per_slot)`` the adapter's :func:`select_owned`. Expert tensor parallelism:
    ``k_parts`` shards of every expert's intermediate dim and ``gather`` the adapter's all-gather.
    ``packs``: :func:`ops.pack_experts` of the weights (an inference engine's), the same bits.
    """
    per_slot = ops.moe_experts(hidden, top_k_index, gate_up, down, experts=experts, k_parts=k_parts, gather=gather,
                               packs=packs)
    if select is not None:
        per_slot = select(per_slot)
    return ops.moe_combine(per_slot, top_k_weights).to(hidden.dtype)


def shared_expert(hidden, gate_up, down, gate_weight, *, packs=None) -> torch.Tensor:
    """Qwen3.5-MoE's shared expert: ``sigmoid(hidden @ gate_weight^T) * down(silu(gate) * up)``, [T, H] in
    ``hidden``'s dtype (:func:`ops.linear`, :func:`ops.silu_mul`, :func:`ops.sigmoid_gate`).

    ``gate_up``: one ``[2I, H]`` weight (gate rows first: vLLM's merged projection) or the pair
    ``(gate [I, H], up [I, H])`` (transformers' two linears) -- the same bits, every output entry of
    :func:`ops.linear` is computed alone. ``gate_weight``: ``[1, H]``. ``packs``: optional
    :func:`ops.pack_weight` of ``(gate_up, down, gate_weight)``. The MoE block's output is
    ``routed + shared``, both in ``hidden``'s dtype (transformers' ``expert_output + shared_expert_output``;
    one correctly rounded add, so its order cannot change the bits).
    """
    gate_up_pack, down_pack, gate_pack = (None, None, None) if packs is None else packs
    if isinstance(gate_up, torch.Tensor):
        gate, up = ops.linear(hidden, gate_up, pack=gate_up_pack).chunk(2, dim=-1)
    else:
        gate, up = (ops.linear(hidden, weight) for weight in gate_up)
    out = ops.linear(ops.silu_mul(gate, up), down, pack=down_pack)
    return ops.sigmoid_gate(out, ops.linear(hidden, gate_weight, pack=gate_pack))
