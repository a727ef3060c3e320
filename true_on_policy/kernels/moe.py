"""The MoE ops and the one MoE forward of every engine: fp32 router, stable top-k, per-expert consistent
linears, slot-order combine.

The ops (:func:`moe_route`, :func:`moe_experts`, :func:`moe_select`, :func:`moe_combine`) are built on
:mod:`.ops` (its linear, ``fixed_sum``, dispatch) with the same row invariance. The training model's patched
router and experts (:mod:`true_on_policy.transformers_adapter.forwards`), expert parallelism on CPU
(:mod:`.tensor_parallel`) and vLLM's MoE block (:mod:`true_on_policy.vllm_adapter.moe_block`) call the
forward's functions; an adapter passes in only its collectives: ``gather`` (every rank's tensor in rank order,
a copy) and its rank. So the expert arithmetic, the expert layout read and the sharded selection cannot drift
between the engines.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from true_on_policy.kernels import ops, row_parallel
from true_on_policy.kernels.architectures import UnsupportedFeatureError
from true_on_policy.kernels.row_parallel import Gather

__all__ = [
    "EXPERT_LAYOUT",
    "check_expert_layout",
    "moe_route",
    "moe_experts",
    "moe_select",
    "moe_combine",
    "route",
    "select_owned",
    "experts_forward",
    "shared_expert",
]

# The transformers experts' layout the consistent experts read: gate_up_proj [E, 2I, H] (gate rows
# first), down_proj [E, H, I], no bias. (attribute, the value read; a module without it has that value)
EXPERT_LAYOUT = (("has_bias", False), ("is_transposed", False), ("has_gate", True), ("is_concatenated", True))


def check_expert_layout(experts) -> None:
    """Refuse, naming the attribute, a transformers experts module laid out otherwise than :data:`EXPERT_LAYOUT`."""
    for flag, wanted in EXPERT_LAYOUT:
        if getattr(experts, flag, wanted) != wanted:
            raise UnsupportedFeatureError(f"true_on_policy: experts with {flag}={not wanted} are not supported")


# ----------------------------------------------------------------------------------------------
# The MoE ops
# ----------------------------------------------------------------------------------------------


def moe_route(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax over experts, then the top-k with ties broken towards the lower expert index.

    Returns ``(weights fp32 [T, k], experts long [T, k])``, best first. Invariant: per-row fp32
    math (max, :func:`ops.fixed_sum`, exp, divide) and a STABLE descending sort, so the selection and
    weights of a token never depend on the other tokens or on ``torch.topk``'s tie order.
    Bits: rest on vml_exp.
    """
    x = router_logits.to(torch.float32)
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    probs = e / ops.fixed_sum(e)
    if ops.switches().fault.router_ties_to_higher:  # a planted fault (diagnosis only): the tie order reversed
        values, indices = torch.sort(probs.flip(-1), dim=-1, descending=True, stable=True)
        indices = (probs.shape[-1] - 1) - indices
    else:
        values, indices = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, experts = values[..., :top_k], indices[..., :top_k]
    if norm_topk_prob:
        weights = weights / ops.fixed_sum(weights)
    return weights, experts


def moe_experts(hidden, top_k_index, gate_up, down, *, experts=None, k_parts=1, gather=None, packs=None):
    """Every (token, slot) pair through its expert: [tokens, top_k, hidden] in slot order.

    Pairs are grouped by expert with a stable sort (token order inside an expert), each expert runs
    ``down(silu(gate) * up)`` on its rows with :func:`ops.linear`, and the rows go back to their slots.
    ``gate_up[e]`` is [2 * inter, hidden] (gate rows first), ``down[e]`` is [hidden, inter]. Both
    engines call this one function, so the expert arithmetic cannot drift between them. Sharded:

    * ``experts`` (expert parallelism): the global ids of the experts ``gate_up``/``down`` hold, in
      their order; pairs routed to other experts get zero rows (:func:`moe_select` takes each slot
      from the rank that holds its expert).
    * ``k_parts`` > 1 (expert tensor parallelism): every expert's intermediate dim is split in
      ``k_parts`` shards and these weights hold one (gate rows then up rows of the shard; the down
      projection's columns): the down projection is the shard's fp32 subtree (:func:`ops.linear`),
      ``gather(partials)`` returns every shard's, in shard order, and :func:`ops.tree_combine` plus
      :func:`ops.linear_epilogue` finish it -- bitwise the unsharded experts.

    ``packs``: :func:`ops.pack_experts` of these weights (an inference engine's, built once per weight load): the
    same bits.
    Bits: rest on mkl_sgemm (the linears; the native routes' are the project's fma chains) and
    vml_exp (the activation).
    """
    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    held = list(range(len(gate_up))) if experts is None else [int(e) for e in experts]
    if len(held) != len(gate_up):
        raise ValueError(f"moe_experts: {len(gate_up)} expert weights for expert ids {held}")
    if k_parts > 1 and gather is None:
        raise ValueError("moe_experts: k_parts > 1 needs gather (the shards' partials in shard order)")
    if packs is not None and not (len(packs) == 2 and len(packs[0]) == len(packs[1]) == len(gate_up)):
        raise ValueError(f"moe_experts: packs must be (gate_up packs, down packs) for {len(gate_up)} experts")
    if (kernel := ops._route("moe_experts", hidden.device, hidden, gate_up, down, k_parts, experts, packs)).run:
        gate_up_list, down_list = list(gate_up), list(down)
        leaves = (ops.local_leaves(hidden.shape[-1], 1), ops.local_leaves(down_list[0].shape[-1], 1))
        if kernel.path == "dot":
            kernel_packs = [[p.tensors for p in part] for part in packs]
        else:
            kernel_packs = [[p.tensors[0] for p in part] for part in packs] if packs is not None else [[], []]
        per_slot = kernel.run(hidden, top_k_index, gate_up_list, down_list, *kernel_packs, ops.K_CHUNK, *leaves)
        return per_slot.view(tokens, top_k, hidden.shape[-1])
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=max(held, default=-1) + 1).tolist()
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    pair_ids, outputs = [], []
    out_dtype = torch.float32 if k_parts > 1 else hidden.dtype
    for local, expert in enumerate(held):
        count = counts[expert]
        if count == 0:
            continue
        pairs = order[starts[expert] : starts[expert] + count]
        x = hidden[pairs // top_k]
        gate_up_pack, down_pack = (None, None) if packs is None else (packs[0][local], packs[1][local])
        gate, up = ops.linear(x, gate_up[local], pack=gate_up_pack).chunk(2, dim=-1)
        hidden_act = ops.silu_mul(gate, up)
        outputs.append(ops.linear(hidden_act, down[local], None, out_dtype, k_parts=k_parts, pack=down_pack))
        pair_ids.append(pairs)
    width = hidden.shape[-1]
    grouped = torch.cat(outputs) if outputs else hidden.new_zeros(0, width, dtype=out_dtype)
    if k_parts > 1:  # every rank ran every pair: the same rows in the same order
        grouped = ops.linear_epilogue(ops.tree_combine(gather(grouped)), None, hidden.dtype)
    per_slot = hidden.new_zeros(tokens * top_k, width)
    if outputs:
        per_slot[torch.cat(pair_ids)] = grouped
    return per_slot.view(tokens, top_k, width)


def moe_select(per_slot_by_rank: list[torch.Tensor], owner: torch.Tensor) -> torch.Tensor:
    """Expert parallelism: slot (t, s) taken from rank ``owner[t, s]``'s :func:`moe_experts` rows.

    A selection, no arithmetic: the result is bitwise the unsharded experts' per-slot rows whatever
    rank holds which expert, and :func:`moe_combine` then adds them in slot order.
    """
    stacked = torch.stack(per_slot_by_rank)  # [ranks, T, k, H]
    index = owner.long()[None, :, :, None].expand(1, *stacked.shape[1:])
    return stacked.gather(0, index)[0]


def moe_combine(expert_outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_k weights[:, k] * expert_outputs[:, k]`` in fp32, added in slot order k = 0, 1, ...

    ``expert_outputs`` [T, k, H] holds each token's output of its k-th selected expert.
    Invariant: a token's combination is a fixed left-to-right chain of elementwise fp32 ops,
    independent of how tokens were grouped per expert. Returns fp32 [T, H].
    Bits: the project's order.
    """
    y = expert_outputs.to(torch.float32) * weights.to(torch.float32)[..., None]
    out = y[:, 0]
    for slot in range(1, y.shape[1]):
        out = out + y[:, slot]
    return out


# ----------------------------------------------------------------------------------------------
# The MoE forward
# ----------------------------------------------------------------------------------------------


def route(hidden: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool, pack=None):
    """fp32 router logits (:func:`ops.linear`) and their stable top-k (:func:`moe_route`):
    ``(logits [T, E], weights fp32 [T, k], expert ids [T, k])``. ``pack``: the router weight's
    :func:`ops.pack_weight` (an inference engine's), the same bits. Qwen3-MoE renormalizes as its
    ``norm_topk_prob`` says; Qwen3.5-MoE's router (``Qwen3_5MoeTopKRouter``: softmax, top-k) always does."""
    logits = ops.linear(hidden, router_weight, out_dtype=torch.float32, pack=pack)
    weights, experts = moe_route(logits, top_k, renormalize)
    return logits, weights, experts


class _SelectOwned(torch.autograd.Function):
    """Forward: :func:`moe_select` over every rank's per-slot rows; backward: this rank's rows get the
    gradient of the slots it owns (every rank computes the same replicated loss from the selected rows)."""

    @staticmethod
    def forward(ctx, per_slot, owner, gather, rank):
        ctx.save_for_backward(owner)
        ctx.rank = rank
        return moe_select(gather(per_slot), owner)

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
    return moe_select(gather(per_slot), owner)


def experts_forward(hidden, top_k_index, top_k_weights, gate_up, down, *, packs=None, experts=None,
                    select: Callable[[torch.Tensor], torch.Tensor] | None = None, k_parts: int = 1,
                    gather: Gather | None = None) -> torch.Tensor:
    """Every token through its top-k experts (:func:`moe_experts`), combined in slot order
    (:func:`moe_combine`), cast to ``hidden``'s dtype: [T, H].

    Unsharded: ``gate_up``/``down`` hold every expert. Expert parallelism: ``experts`` the global ids
    they hold and ``select(per_slot)`` the adapter's :func:`select_owned`. Expert tensor parallelism:
    ``k_parts`` shards of every expert's intermediate dim and ``gather`` the adapter's all-gather.
    ``packs``: :func:`ops.pack_experts` of the weights (an inference engine's), the same bits.
    """
    per_slot = moe_experts(hidden, top_k_index, gate_up, down, experts=experts, k_parts=k_parts, gather=gather,
                               packs=packs)
    if select is not None:
        per_slot = select(per_slot)
    return moe_combine(per_slot, top_k_weights).to(hidden.dtype)


def shared_expert(hidden, gate_up, down, gate_weight, *, packs=None, k_parts: int = 1,
                  gather: Gather | None = None) -> torch.Tensor:
    """Qwen3.5-MoE's shared expert: ``sigmoid(hidden @ gate_weight^T) * down(silu(gate) * up)``, [T, H] in
    ``hidden``'s dtype (:func:`ops.linear`, :func:`ops.silu_mul`, :func:`ops.sigmoid_gate`).

    ``gate_up``: one ``[2I, H]`` weight (gate rows first: vLLM's merged projection) or the pair
    ``(gate [I, H], up [I, H])`` (transformers' two linears) -- the same bits, every output entry of
    :func:`ops.linear` is computed alone. ``gate_weight``: ``[1, H]``. ``packs``: optional
    :func:`ops.pack_weight` of ``(gate_up, down, gate_weight)``. The MoE block's output is
    ``routed + shared``, both in ``hidden``'s dtype (transformers' ``expert_output + shared_expert_output``;
    one correctly rounded add, so its order cannot change the bits). Tensor-parallel (``k_parts`` ranks):
    ``gate_up`` this rank's column shard, ``down`` its row shard, folded by
    :func:`row_parallel.row_parallel_linear` over ``gather``: the unsharded bits.
    """
    gate_up_pack, down_pack, gate_pack = (None, None, None) if packs is None else packs
    if isinstance(gate_up, torch.Tensor):
        gate, up = ops.linear(hidden, gate_up, pack=gate_up_pack).chunk(2, dim=-1)
    else:
        gate, up = (ops.linear(hidden, weight) for weight in gate_up)
    out = row_parallel.row_parallel_linear(ops.silu_mul(gate, up), down, None, k_parts, gather, pack=down_pack)
    return ops.sigmoid_gate(out, ops.linear(hidden, gate_weight, pack=gate_pack))
