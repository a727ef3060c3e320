"""vLLM's MoE blocks on the training side's one MoE forward (:mod:`true_on_policy.kernels.moe`), the
experts' weights as loaded, each laid out once for its native call (:func:`.weight_packs.expert_weights`).

Sharded, the block splits experts by TP (intermediate dim, fp32 subtrees gathered) or by EP (each
slot's row from its expert's rank), so every TP / EP size computes the unsharded experts' bits.
"""

from __future__ import annotations

import functools

import torch

from true_on_policy.kernels import moe
from true_on_policy.kernels.architectures import UnsupportedFeatureError
from true_on_policy.vllm_adapter.process_groups import ep_group, gather, gather_list, tp_group
from true_on_policy.vllm_adapter.weight_packs import expert_weights, weight_pack

_HOLDER = "_true_on_policy_experts"  # the MoE block's module holding the experts' weights


def moe_block_forward(block, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE sparse block: fp32 router + stable top-k, per-expert linears, slot-order combine.

    The expert weights are vLLM's ``w13_weight`` [E, 2I, H] (gate rows, then up rows: HF's
    ``gate_up_proj``) and ``w2_weight`` [E, H, I], used unpacked, exactly as the training side's
    experts use ``gate_up_proj``/``down_proj``. Sharded (activations are replicated over the ranks):
    with expert parallelism a rank holds whole experts (``expert_map``) and each slot's row is taken
    from the rank holding its expert (:func:`moe.moe_select`); with TP alone every expert's
    intermediate dim is split and the down projections' fp32 subtrees are gathered and folded
    (:func:`moe.moe_experts` with ``k_parts``). Either way: the unsharded experts' bits.
    """
    top_k, renormalize, num_experts = block.true_on_policy_moe
    holder = _experts_holder(block)
    gate_up, down, packs = expert_weights(holder)
    parallel = holder.moe_config.moe_parallel_config
    shape = hidden_states.shape
    h = hidden_states.reshape(-1, shape[-1])
    _, weights, chosen = moe.route(h, block.gate.weight, top_k, renormalize, pack=weight_pack(block.gate))
    sharding = {}
    if parallel.use_ep and parallel.ep_size > 1:
        local, owner = _expert_parallel_layout(holder, num_experts)
        sharding = dict(experts=local, select=functools.partial(_select_owned, owner=owner[chosen]))
    elif parallel.tp_size > 1:
        sharding = dict(k_parts=parallel.tp_size, gather=gather(tp_group))
    elif len(gate_up) != num_experts:
        raise UnsupportedFeatureError(f"true_on_policy (vLLM): {len(gate_up)} local experts of {num_experts}")
    return moe.experts_forward(h, chosen, weights, gate_up, down, packs=packs, **sharding).view(shape)


def moe_shared_block_forward(block, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen3.5-MoE's sparse block (vLLM's ``Qwen3NextSparseMoeBlock``): the routed experts as
    :func:`moe_block_forward`, plus the sigmoid-gated shared expert (:func:`moe.shared_expert` on the
    shared MLP's merged ``gate_up_proj``, its ``down_proj`` and ``shared_expert_gate``; at TP > 1 their
    shards, ``down_proj`` folded through the row-parallel tree), added once in the model dtype as
    transformers' ``expert_output + shared_expert_output``."""
    shape = hidden_states.shape
    h = hidden_states.reshape(-1, shape[-1])
    shared = block.shared_expert
    packs = (weight_pack(shared.gate_up_proj), weight_pack(shared.down_proj), weight_pack(block.shared_expert_gate))
    # its projections sharded by the model's TP (with or without EP): column shard in, row shard folded
    shared_out = moe.shared_expert(h, shared.gate_up_proj.weight, shared.down_proj.weight,
                                   block.shared_expert_gate.weight, packs=packs, k_parts=shared.down_proj.tp_size,
                                   gather=gather(tp_group))
    return (moe_block_forward(block, h) + shared_out).view(shape)


def _experts_holder(block):
    """The MoE block's one module holding the experts' weights (``w13_weight``), found once."""
    holder = block.__dict__.get(_HOLDER)
    if holder is None:
        holders = [m for m in block.experts.modules() if hasattr(m, "w13_weight")]
        if len(holders) != 1:
            raise UnsupportedFeatureError(f"true_on_policy (vLLM): {len(holders)} expert weight holders in one MoE block")
        holder = block.__dict__[_HOLDER] = holders[0]
    return holder


def _select_owned(per_slot: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    return moe.select_owned(per_slot, owner, gather(ep_group), ep_group().rank_in_group)


def _expert_parallel_layout(holder, num_experts: int) -> tuple[list[int], torch.Tensor]:
    """(the global ids of this rank's experts in the order of its weights, the EP rank holding each expert),
    from vLLM's ``expert_map``."""
    expert_map = holder.expert_map  # global id -> local index, -1 where another rank holds it
    if expert_map is None or expert_map.numel() != num_experts:
        raise UnsupportedFeatureError(f"true_on_policy (vLLM): an expert map of {expert_map} for {num_experts} experts")
    owner = holder.__dict__.get("_true_on_policy_owner")
    if owner is None:  # which rank holds each expert: the ranks' maps, gathered once
        maps = torch.stack(gather_list(ep_group(), expert_map.to(torch.long)))
        if not bool(((maps >= 0).sum(0) == 1).all()):
            raise UnsupportedFeatureError("true_on_policy (vLLM): an expert held by no or several EP ranks (EPLB)")
        owner = (maps >= 0).to(torch.long).argmax(0)
        holder.__dict__["_true_on_policy_owner"] = owner
    local = torch.nonzero(expert_map >= 0).flatten()
    return local[torch.argsort(expert_map[local])].tolist(), owner

