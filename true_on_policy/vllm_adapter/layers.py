"""Replacement modules for vLLM's layers, each running :mod:`true_on_policy.kernels.ops`.

Built on vLLM's public extension points (registered by :mod:`.patches`): out-of-tree custom ops
(``CustomOp.register_oot``) for RMSNorm, SiluAndMul and RotaryEmbedding, an attention backend
registered for ``AttentionBackendEnum.CPU_ATTN``, and plain functions that :mod:`.patches` puts
in place of the linear method, the LM head, the log-softmax and the MoE block. Each op computes
what the training forward (:mod:`true_on_policy.kernels.model`) computes for the same token:

* RMSNorm: vLLM's fused ``norm(x, residual)`` is HF's ``residual + x`` in the model dtype, then
  :func:`ops.rms_norm` (HF adds the residual in the model dtype, vLLM's stock kernel in fp32).
* linear: one :func:`ops.linear` per projection of a fused layer (qkv, gate_up), on the unpacked
  weight, so each projection's bits are those of the training model's separate ``nn.Linear``; each
  projection's weight laid out once for its native path (:func:`linear_packs`, rebuilt after every
  weight load), which decode's few rows read.
* MoE: the training side's one MoE forward (:mod:`true_on_policy.kernels.moe`) on the experts' weights
  as loaded, each laid out once for its native call (:func:`expert_weights`, rebuilt after every weight load).
* attention: keys/values stored unpacked in vLLM's paged cache and read there by
  :func:`ops.paged_attention` -- :func:`ops.attention` (absolute-position KV blocks, the same
  rescale cadence) on the cache in place.

Tensor / expert parallelism (vLLM's own sharding, any TP a power of two <= ``ops.MAX_TP``): a
column-parallel shard (qkv, gate_up, the vocabulary-parallel LM head) computes its features' bits
and vLLM gathers them (the logits: all-gather, never a reduction); a row-parallel layer
(:func:`row_parallel_forward`: o_proj, down_proj) runs the one row-parallel reduction of
:mod:`true_on_policy.kernels.row_parallel` over vLLM's all-gather; the vocabulary-parallel embedding's all-reduce adds
exact ``-0.0`` (:func:`vocab_parallel_embedding_forward`); the MoE block splits experts by TP
(intermediate dim, fp32 subtrees gathered) or by EP (each slot's row from its expert's rank). So
every TP / EP size computes the unsharded model's bits.
"""

from __future__ import annotations

import functools

import torch

from true_on_policy.kernels import gated_delta, moe, ops, row_parallel
from true_on_policy.kernels.architectures import UnsupportedFeatureError

from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.linear_scaling_rope import LinearScalingRotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding
from vllm.v1.attention.backend import AttentionMetadataBuilder, AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

# ----------------------------------------------------------------------------------------------
# Out-of-tree custom ops
# ----------------------------------------------------------------------------------------------


class ConsistentRMSNorm(RMSNorm):
    """vLLM's RMSNorm (optionally fused with the residual add) as HF's RMSNorm on ops.rms_norm."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.variance_size_override is not None or not self.has_weight:
            raise UnsupportedFeatureError(
                "true_on_policy (vLLM): RMSNorm with var_hidden_size or without weight is not covered"
            )
        if residual is None:
            return ops.rms_norm(x, self.weight, self.variance_epsilon)
        summed = residual + x  # HF: hidden_states = residual + hidden_states, in the model dtype
        return ops.rms_norm(summed, self.weight, self.variance_epsilon), summed


class ConsistentGemmaRMSNorm(GemmaRMSNorm):
    """vLLM's GemmaRMSNorm (Qwen3.5's RMSNorm, ``x * (1 + w)``) on ``ops.rms_norm(unit_offset=True)``,
    its fused residual add as :class:`ConsistentRMSNorm`'s (HF's ``residual + x`` in the model dtype)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.variance_epsilon, unit_offset=True)
        summed = residual + x
        return ops.rms_norm(summed, self.weight, self.variance_epsilon, unit_offset=True), summed


class ConsistentSiluAndMul(SiluAndMul):
    """``silu(gate) * up`` with the fp32 exp-based SiLU of the training MLP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return ops.silu_mul(x[..., :d], x[..., d:])


class _ConsistentRope:
    """NeoX RoPE from the training side's one fp32 table (:func:`ops.rope_table`), fp32 rotation.

    Each subclass names its vLLM RoPE class's parameters as the HF ``rope_parameters`` the
    training side reads from the same config, so both engines build the same table. Partial RoPE
    (``rotary_dim < head_size``, Qwen3.5): the table of the ``rotary_dim`` rotated features (transformers
    computes the frequencies over them), which :func:`ops.apply_rope` applies to the head's first
    ``rotary_dim`` features, passing the rest through.
    """

    def _rope_parameters(self) -> dict:
        return {"rope_type": "default", "rope_theta": float(self.base)}

    def _table(self, device):
        cached = self.__dict__.get("_true_on_policy_rope")
        if cached is None or cached[0] != device:
            if not self.is_neox_style or self.rotary_dim > self.head_size:
                raise UnsupportedFeatureError(
                    f"true_on_policy (vLLM): RoPE with rotary_dim={self.rotary_dim} of head_size={self.head_size}, "
                    f"is_neox_style={self.is_neox_style} is not covered (NeoX rotation only)"
                )
            config = {
                "rope_parameters": self._rope_parameters(),
                "head_dim": self.rotary_dim,  # the table's width: the rotated features
                "max_position_embeddings": self.max_position_embeddings,
            }
            cos, sin = ops.rope_table(config, device=device)
            cached = (device, cos, sin)
            self.__dict__["_true_on_policy_rope"] = cached
        return cached[1], cached[2]

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None, *args):
        if args or key is None:
            raise UnsupportedFeatureError("true_on_policy (vLLM): RoPE without key or with offsets is not covered")
        cos, sin = self._table(query.device)
        positions = positions.flatten()
        if positions.numel() and int(positions.max()) >= cos.shape[0]:
            raise UnsupportedFeatureError(
                f"true_on_policy (vLLM): position {int(positions.max())} is outside the RoPE table "
                f"[0, max_position_embeddings={cos.shape[0]})"
            )
        c, s = cos[positions], sin[positions]
        n = positions.shape[0]
        q = ops.apply_rope(query.view(n, -1, self.head_size), c, s, 1).reshape(query.shape)
        k = ops.apply_rope(key.view(n, -1, self.head_size), c, s, 1).reshape(key.shape)
        return q, k


class ConsistentRotaryEmbedding(_ConsistentRope, RotaryEmbedding):
    """vLLM's default RoPE (``rope_type: default``) on the one fp32 table."""


class ConsistentLinearScalingRotaryEmbedding(_ConsistentRope, LinearScalingRotaryEmbedding):
    """``rope_type: linear``: frequencies divided by the factor, as the training side's table."""

    def _rope_parameters(self) -> dict:
        if len(self.scaling_factors) != 1:
            raise UnsupportedFeatureError(
                f"true_on_policy (vLLM): linear RoPE scaling with several factors {self.scaling_factors} is not covered"
            )
        return {"rope_type": "linear", "rope_theta": float(self.base), "factor": self.scaling_factors[0]}


class ConsistentLlama3RotaryEmbedding(_ConsistentRope, Llama3RotaryEmbedding):
    """``rope_type: llama3`` (Llama 3.1+): the same scaled frequencies as the training side's table."""

    def _rope_parameters(self) -> dict:
        return {
            "rope_type": "llama3",
            "rope_theta": float(self.base),
            "factor": self.scaling_factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.orig_max_position,
        }


# vLLM class name -> its consistent replacement (registered by .patches as out-of-tree custom ops)
CONSISTENT_ROPES = {
    "RotaryEmbedding": ConsistentRotaryEmbedding,
    "LinearScalingRotaryEmbedding": ConsistentLinearScalingRotaryEmbedding,
    "Llama3RotaryEmbedding": ConsistentLlama3RotaryEmbedding,
}


# ----------------------------------------------------------------------------------------------
# Linear layers, LM head, log-softmax, MoE
# ----------------------------------------------------------------------------------------------


def linear_apply(layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One :func:`ops.linear` per output partition (q, k, v / gate, up), concatenated, each reading its
    partition's pack (:func:`linear_packs`)."""
    weight = layer.weight
    sizes = list(getattr(layer, "output_partition_sizes", None) or [weight.shape[0]])
    if sum(sizes) != weight.shape[0]:
        raise UnsupportedFeatureError(
            f"true_on_policy (vLLM): {type(layer).__name__} partitions {sizes} do not cover its weight "
            f"{tuple(weight.shape)}"
        )
    packs = linear_packs(layer, sizes)
    if len(sizes) == 1:
        return ops.linear(x, weight, bias, pack=packs[0])
    outs, start = [], 0
    for size, pack in zip(sizes, packs):
        b = None if bias is None else bias[start : start + size]
        outs.append(ops.linear(x, weight[start : start + size], b, pack=pack))
        start += size
    return torch.cat(outs, dim=-1)


def lm_head_logits(lm_head, hidden_states: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits from the consistent linear (the training side's ConsistentLMHead); at TP > 1 this
    rank's vocabulary shard, which vLLM's logits processor all-gathers."""
    return ops.linear(hidden_states, lm_head.weight, bias, out_dtype=torch.float32, pack=weight_pack(lm_head))


def _tp_group():
    from vllm.distributed import get_tp_group

    return get_tp_group()


def _gather_list(group, x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``x`` of vLLM's group ``group``, in rank order (an all-gather: no arithmetic)."""
    if group.world_size == 1:
        return [x]
    return list(group.all_gather(x.unsqueeze(0).contiguous(), dim=0).unbind(0))


def _gather(get_group):
    """The all-gather the shared forwards take (:mod:`true_on_policy.kernels.row_parallel`, :mod:`...moe`),
    over the group ``get_group()`` returns when it runs."""
    return lambda x: _gather_list(get_group(), x)


def row_parallel_forward(layer, input_: torch.Tensor):
    """vLLM's ``RowParallelLinear.forward`` on the reduction tree: :func:`row_parallel.row_parallel_linear`
    over this rank's input shard and vLLM's TP all-gather."""
    tp = layer.tp_size
    if tp > 1 and not layer.reduce_results:
        raise UnsupportedFeatureError(
            f"true_on_policy (vLLM): a row-parallel linear without reduce_results at TP {tp} is not covered"
        )
    if layer.input_is_parallel or tp == 1:
        x = input_
    else:
        x = input_.chunk(tp, dim=-1)[layer.tp_rank].contiguous()
    bias = None if layer.skip_bias_add else layer.bias
    out = row_parallel.row_parallel_linear(x, layer.weight, bias, tp, _gather(_tp_group), pack=weight_pack(layer))
    if not layer.return_bias:
        return out
    return out, (layer.bias if layer.skip_bias_add else None)


def vocab_parallel_embedding_forward(layer, input_: torch.Tensor) -> torch.Tensor:
    """vLLM's ``VocabParallelEmbedding.forward`` whose all-reduce returns each token's row bitwise:
    the ranks not holding the token contribute ``-0.0``, and ``x + (-0.0) == x`` for every x
    (``+0.0`` would turn a ``-0.0`` entry into ``+0.0``), in any order of any all-reduce."""
    from vllm.distributed import tensor_model_parallel_all_reduce
    from vllm.model_executor.layers.vocab_parallel_embedding import get_masked_input_and_mask

    if layer.tp_size == 1:
        return layer.quant_method.embedding(layer, input_.long())
    shard = layer.shard_indices
    masked, hidden = get_masked_input_and_mask(
        input_, shard.org_vocab_start_index, shard.org_vocab_end_index, shard.num_org_vocab_padding,
        shard.added_vocab_start_index, shard.added_vocab_end_index,
    )
    rows = layer.quant_method.embedding(layer, masked.long())
    rows.masked_fill_(hidden.unsqueeze(-1), -0.0)
    return tensor_model_parallel_all_reduce(rows)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """The sampler's log-probs: fp32 full-vocabulary :func:`ops.log_softmax` (temperature applied)."""
    return ops.log_softmax(logits)


_PACKS = "_true_on_policy_packs"


def _kept_packs(holder, build):
    """``build()`` -- ``holder``'s weights laid out once -- kept on ``holder`` (a weight, or the experts'
    module) from its first use until :func:`drop_packs`: :mod:`.patches` drops them whenever vLLM writes
    or post-processes the weights."""
    packs = holder.__dict__.get(_PACKS)
    if packs is None:
        packs = build()
        holder.__dict__[_PACKS] = packs
    return packs


def linear_packs(layer, sizes: list[int]) -> tuple:
    """The :func:`ops.pack_weight` of each output partition of ``layer.weight`` (None where a linear reads
    none), built on first use after every weight load; kept on the weight, which a tied LM head shares
    with the embedding that loads it."""
    weight = layer.weight

    def build():
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return tuple(ops.pack_weight(weight[s : s + size]) for s, size in zip(starts, sizes))

    return _kept_packs(weight, build)


def weight_pack(layer):
    """:func:`linear_packs` of a linear read whole (one partition)."""
    return linear_packs(layer, [layer.weight.shape[0]])[0]


def expert_weights(holder) -> tuple[list, list, tuple | None]:
    """The experts' weights as the per-expert views :func:`moe.moe_experts` takes (gate_up, down) and laid out
    once for its native call (:func:`ops.pack_experts`, or None where it reads none), built on first use
    after every weight load."""
    def build():
        gate_up, down = list(holder.w13_weight), list(holder.w2_weight)
        return gate_up, down, ops.pack_experts(gate_up, down)

    return _kept_packs(holder, build)


def drop_packs(holder) -> None:
    """Forget the :func:`linear_packs` or :func:`expert_weights` kept on ``holder`` (being written)."""
    holder.__dict__.pop(_PACKS, None)


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
        sharding = dict(k_parts=parallel.tp_size, gather=_gather(_tp_group))
    elif len(gate_up) != num_experts:
        raise UnsupportedFeatureError(f"true_on_policy (vLLM): {len(gate_up)} local experts of {num_experts}")
    return moe.experts_forward(h, chosen, weights, gate_up, down, packs=packs, **sharding).view(shape)


def moe_shared_block_forward(block, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen3.5-MoE's sparse block (vLLM's ``Qwen3NextSparseMoeBlock``): the routed experts as
    :func:`moe_block_forward`, plus the sigmoid-gated shared expert (:func:`moe.shared_expert` on the
    shared MLP's merged ``gate_up_proj``, its ``down_proj`` and ``shared_expert_gate``), added once in
    the model dtype as transformers' ``expert_output + shared_expert_output``."""
    shape = hidden_states.shape
    h = hidden_states.reshape(-1, shape[-1])
    shared = block.shared_expert
    packs = (weight_pack(shared.gate_up_proj), weight_pack(shared.down_proj), weight_pack(block.shared_expert_gate))
    shared_out = moe.shared_expert(h, shared.gate_up_proj.weight, shared.down_proj.weight,
                                   block.shared_expert_gate.weight, packs=packs)
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


def _ep_group():
    from vllm.distributed import get_ep_group

    return get_ep_group()


def _select_owned(per_slot: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    return moe.select_owned(per_slot, owner, _gather(_ep_group), _ep_group().rank_in_group)


def _expert_parallel_layout(holder, num_experts: int) -> tuple[list[int], torch.Tensor]:
    """(the global ids of this rank's experts in the order of its weights, the EP rank holding each expert),
    from vLLM's ``expert_map``."""
    expert_map = holder.expert_map  # global id -> local index, -1 where another rank holds it
    if expert_map is None or expert_map.numel() != num_experts:
        raise UnsupportedFeatureError(f"true_on_policy (vLLM): an expert map of {expert_map} for {num_experts} experts")
    owner = holder.__dict__.get("_true_on_policy_owner")
    if owner is None:  # which rank holds each expert: the ranks' maps, gathered once
        maps = torch.stack(_gather_list(_ep_group(), expert_map.to(torch.long)))
        if not bool(((maps >= 0).sum(0) == 1).all()):
            raise UnsupportedFeatureError("true_on_policy (vLLM): an expert held by no or several EP ranks (EPLB)")
        owner = (maps >= 0).to(torch.long).argmax(0)
        holder.__dict__["_true_on_policy_owner"] = owner
    local = torch.nonzero(expert_map >= 0).flatten()
    return local[torch.argsort(expert_map[local])].tolist(), owner


# ----------------------------------------------------------------------------------------------
# Qwen3.5: gated attention, Gated DeltaNet
# ----------------------------------------------------------------------------------------------


def gated_attention_forward(layer, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """vLLM's ``Qwen3NextAttention.forward`` (Qwen3.5's full-attention layers) with the output gate as
    :func:`ops.sigmoid_gate`: vLLM's own split of ``qkv_proj``'s query part into per-head
    ``[query | gate]`` (transformers' ``view(..., -1, 2 * head_dim).chunk(2)``), q/k norm and RoPE on the
    consistent ops, the consistent attention backend, ``o_proj``."""
    if layer.use_fused_qk_norm_rope_gate:
        raise UnsupportedFeatureError("true_on_policy (vLLM): the fused q/k-norm + RoPE + gate kernel is not covered")
    qkv, _ = layer.qkv_proj(hidden_states)
    q, k, v, gate = layer._project_qkv_gate(qkv, positions)
    out = layer.attn(q, k, v)
    if gate is not None:
        out = ops.sigmoid_gate(out, gate)
    output, _ = layer.o_proj(out)
    return output


def gdn_forward(layer, hidden_states: torch.Tensor) -> torch.Tensor:
    """vLLM's ``QwenGatedDeltaNetAttention.forward_cpu`` on :func:`gated_delta.gated_delta_net_varlen`.

    The input projections (``in_proj_qkvz`` as q|k|v and z, ``in_proj_ba`` as b|a) and ``out_proj``
    run the consistent linears; the conv, gating, delta rule and gated norm run the one order-fixed
    op, in the recurrent order with an fp32 state, for prefill chunks and decode steps alike, so a
    token's bits do not depend on how the scheduler split its sequence (:func:`_gdn_step`).
    """
    if layer.gqa_interleaved_layout:
        raise UnsupportedFeatureError("true_on_policy (vLLM): Qwen3-Next's interleaved in_proj_qkvz is not covered")
    if layer.tp_size != 1:
        raise UnsupportedFeatureError(f"true_on_policy (vLLM): Gated DeltaNet at TP {layer.tp_size} is not covered")
    norm = layer.norm
    if (norm.activation != "silu" or not norm.norm_before_gate or norm.group_size is not None
            or layer.conv1d.bias is not None):
        raise UnsupportedFeatureError(
            f"true_on_policy (vLLM): Gated DeltaNet with gated norm activation={norm.activation!r}, norm_before_gate="
            f"{norm.norm_before_gate}, group_size={norm.group_size}, conv bias={layer.conv1d.bias is not None} is not "
            "covered (covered: silu, norm before gate, one group, no conv bias)"
        )
    mixed_qkvz, _ = layer.in_proj_qkvz(hidden_states)
    ba, _ = layer.in_proj_ba(hidden_states)
    mixed_qkv, z = mixed_qkvz.split([layer.key_dim * 2 + layer.value_dim, layer.value_dim], dim=-1)
    b, a = ba.chunk(2, dim=-1)
    y = hidden_states.new_zeros(hidden_states.shape[0], layer.value_dim)
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if metadata is not None:  # None: vLLM's warm-up / profile run, which has no state slots
        _gdn_step(layer, metadata[layer.prefix], mixed_qkv, z, b, a, y)
    output, _ = layer.out_proj(y)
    return output


def _gdn_step(layer, m, mixed_qkv, z, b, a, y) -> None:
    """One step's requests (decodes first, then prefill chunks: vLLM's order) through the op, each
    entering with its slot's conv and recurrent state (zeros where a prefill has none yet) and
    leaving its new state in the slot; ``y``'s rows of the step's tokens written."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    if m.num_spec_decodes or m.spec_sequence_masks is not None:
        raise UnsupportedFeatureError("true_on_policy (vLLM): speculative decoding on Gated DeltaNet is not covered")
    requests, n = m.num_decodes + m.num_prefills, m.num_actual_tokens
    if requests == 0 or n == 0:
        return
    bounds = m.non_spec_query_start_loc[: requests + 1].long()
    slots = m.non_spec_state_indices_tensor[:requests].long()
    conv_cache, state_cache = layer.kv_cache[0], layer.kv_cache[1]
    if not is_conv_state_dim_first():  # (slots, K - 1, dim) -> the op's (slots, dim, K - 1)
        conv_cache = conv_cache.transpose(-1, -2)
    taps = layer.conv1d.weight.shape[-1]
    if conv_cache.shape[-1] != taps - 1 or state_cache.dtype != torch.float32:
        raise UnsupportedFeatureError(
            f"true_on_policy (vLLM): Gated DeltaNet state slots conv {tuple(conv_cache.shape[1:])}, recurrent "
            f"{state_cache.dtype} (covered: conv (dim, {taps - 1}), recurrent torch.float32)"
        )
    fresh = torch.zeros(requests, dtype=torch.bool)
    if m.num_prefills:
        fresh[m.num_decodes :] = ~m.has_initial_state[m.num_decodes : requests].to(torch.bool)
    keep = (~fresh)[:, None, None]
    conv = torch.where(keep, conv_cache[slots], torch.zeros((), dtype=conv_cache.dtype))
    recurrent = torch.where(keep[..., None], state_cache[slots], torch.zeros((), dtype=torch.float32))
    out, state = gated_delta.gated_delta_net_varlen(
        mixed_qkv[:n], z[:n], a[:n], b[:n], cu_seqlens=bounds, conv_weight=layer.conv1d.weight,
        # transformers holds A_log in the model dtype; vLLM keeps it fp32: the training model's value
        A_log=layer.A_log.to(layer.dt_bias.dtype), dt_bias=layer.dt_bias, norm_weight=layer.norm.weight,
        head_k_dim=layer.head_k_dim, head_v_dim=layer.head_v_dim, eps=layer.norm.eps,
        state=gated_delta.GatedDeltaState(conv, recurrent),
    )
    y[:n] = out
    conv_cache[slots] = state.conv
    state_cache[slots] = state.recurrent


# ----------------------------------------------------------------------------------------------
# Attention backend
# ----------------------------------------------------------------------------------------------


class ConsistentAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """The CPU backend's metadata, without the C++ kernel's scheduler metadata."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> CPUAttentionMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            raise UnsupportedFeatureError("true_on_policy (vLLM): non-causal attention is not covered")
        return CPUAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc,
            max_seq_len=m.max_seq_len,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            scheduler_metadata=None,
            causal=True,
        )


def _paged_layout(impl, query, kv_cache, m):
    """Requests of one step as grids: queries [S, Tq, Hq, D] with their absolute positions (-1:
    padding), and each request's keys/values in the paged cache (:class:`ops.PagedKV`), where the
    slot index IS the absolute position; ``kv_valid`` [S, Tk] marks the slots before seq_len."""
    key_cache, value_cache = ConsistentAttentionImpl._split(kv_cache)
    n, seg, local, q_positions, kv_valid, table = _step_layout(m, key_cache.shape[2], query.device)
    q_grid = query.new_zeros(*q_positions.shape, impl.num_heads, impl.head_size)
    q_grid[seg, local] = query[:n].view(n, impl.num_heads, impl.head_size)
    return n, seg, local, q_grid, q_positions, ops.PagedKV(key_cache, value_cache, table), kv_valid


_STEP = "_true_on_policy_step"  # one metadata object per step, shared by its attention layers


def _step_cache(m) -> tuple[dict, dict]:
    """The step's layouts (by block size) and plans (by block size and heads), kept on its metadata."""
    return m.__dict__.setdefault(_STEP, ({}, {}))


def _step_layout(m, block_size: int, device):
    """What :func:`_paged_layout` derives from the step's metadata alone, computed by the step's first
    attention layer and kept on the metadata for the others."""
    layouts, _ = _step_cache(m)
    if block_size not in layouts:  # index tensors live with the cache (CPU on vLLM-CPU, the GPU on CUDA)
        n = m.num_actual_tokens
        qsl = m.query_start_loc.long()
        seq_lens = m.seq_lens.long()
        S = seq_lens.shape[0]
        q_lens = qsl[1 : S + 1] - qsl[:S]
        Tq, Tk = int(q_lens.max()), int(seq_lens.max())
        n_blocks = -(-Tk // block_size)
        kv_valid = torch.arange(n_blocks * block_size, device=device)[None] < seq_lens[:, None]
        seg = torch.repeat_interleave(torch.arange(S, device=device), q_lens)
        local = torch.arange(n, device=device) - qsl[:S][seg]
        q_positions = torch.full((S, Tq), -1, dtype=torch.long, device=device)
        q_positions[seg, local] = (seq_lens - q_lens)[seg] + local
        layouts[block_size] = (n, seg, local, q_positions, kv_valid, m.block_table[:S, :n_blocks])
    return layouts[block_size]


def _step_plan(m, block_size: int, num_heads: int, num_kv_heads: int, device) -> ops.AttentionPlan:
    """The step's :func:`ops.attention_plan` for these heads, built once per step (see :func:`_step_layout`)."""
    _, plans = _step_cache(m)
    key = (block_size, num_heads, num_kv_heads)
    if key not in plans:
        _, _, _, q_positions, kv_valid, _ = _step_layout(m, block_size, device)
        plans[key] = ops.attention_plan(q_positions, kv_valid, num_heads, num_kv_heads)
    return plans[key]


class ConsistentAttentionImpl(CPUAttentionBackendImpl):
    """Decoder attention over vLLM's paged KV cache with :func:`ops.attention`.

    The cache keeps vLLM-CPU's shape [blocks, Hkv, block_size, 2 * D] but holds plain keys
    (first D) and values (last D), written here; each step reads every request's blocks in place
    (:func:`ops.paged_attention`), keys indexed by absolute position, with the training forward's kernel.
    """

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None):
        self._refuse_uncovered(alibi_slopes, sliding_window, logits_soft_cap, sinks, kv_sharing_target_layer_name,
                               attn_type, kv_cache_dtype)
        super().__init__(num_heads, head_size, scale, num_kv_heads, None, None, kv_cache_dtype)

    @staticmethod
    def _refuse_uncovered(alibi_slopes, sliding_window, logits_soft_cap, sinks, kv_sharing_target_layer_name,
                          attn_type, kv_cache_dtype) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
            "sinks": sinks,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
        }
        for name, value in unsupported.items():
            if value is not None:
                raise UnsupportedFeatureError(f"true_on_policy (vLLM): attention {name}={value!r} is not covered")
        if attn_type != AttentionType.DECODER:
            raise UnsupportedFeatureError(f"true_on_policy (vLLM): attention type {attn_type!r} is not covered")
        if kv_cache_dtype != "auto":
            raise UnsupportedFeatureError(f"true_on_policy (vLLM): kv_cache_dtype={kv_cache_dtype!r} is not covered")

    @staticmethod
    def _split(kv_cache: torch.Tensor):
        blocks, hkv, block_size, _ = kv_cache.shape
        return kv_cache.view(blocks, hkv, 2 * block_size, -1).chunk(2, dim=2)  # views: keys, values

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = ConsistentAttentionImpl._split(kv_cache)
        block_size = key_cache.shape[2]
        slots = slot_mapping[: key.shape[0]].long()
        keep = slots >= 0  # padding tokens carry slot -1
        slots, k, v = slots[keep], key[: keep.shape[0]][keep], value[: keep.shape[0]][keep]
        blocks, offsets = slots // block_size, slots % block_size
        key_cache[blocks, :, offsets] = k.to(key_cache.dtype)
        value_cache[blocks, :, offsets] = v.to(value_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedFeatureError("true_on_policy (vLLM): fused output quantization is not covered")
        if attn_metadata is None:  # warm-up
            return output
        n, seg, local, q_grid, q_positions, paged, kv_valid = _paged_layout(self, query, kv_cache, attn_metadata)
        plan = _step_plan(attn_metadata, paged.key_cache.shape[2], self.num_heads, self.num_kv_heads, query.device)
        out = ops.paged_attention(q_grid.transpose(1, 2), paged, plan, self.scale)
        rows = out.transpose(1, 2)[seg, local]  # [n, Hq, D]
        output[:n].copy_(rows.reshape(output[:n].shape))
        return output


class ConsistentAttentionBackend(CPUAttentionBackend):
    """vLLM-CPU's attention backend with :class:`ConsistentAttentionImpl` (any head size)."""

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(1, 1025))

    @staticmethod
    def get_impl_cls():
        return ConsistentAttentionImpl

    @staticmethod
    def get_builder_cls():
        return ConsistentAttentionMetadataBuilder


# ----------------------------------------------------------------------------------------------
# The same backend on a device platform (vLLM on CUDA, true_on_policy.kernels=project): written,
# not run on a device. Only construction differs: the CPU classes probe the CPU attention ISA in
# __init__, which a device build has no kernel for; metadata, cache layout and forward are shared.
# ----------------------------------------------------------------------------------------------


class DeviceAttentionMetadataBuilder(ConsistentAttentionMetadataBuilder):
    """:class:`ConsistentAttentionMetadataBuilder` without the CPU builder's ISA probe."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)


class DeviceAttentionImpl(ConsistentAttentionImpl):
    """:class:`ConsistentAttentionImpl` without the CPU implementation's ISA probe."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None):
        self._refuse_uncovered(alibi_slopes, sliding_window, logits_soft_cap, sinks, kv_sharing_target_layer_name,
                               attn_type, kv_cache_dtype)
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads, self.num_queries_per_kv = num_kv_heads, num_heads // num_kv_heads
        self.kv_cache_dtype, self.attn_type = kv_cache_dtype, attn_type
        self.alibi_slopes, self.sliding_window, self.logits_soft_cap, self.sinks = None, -1, 0, None
        self.kv_sharing_target_layer_name = None


class DeviceAttentionBackend(ConsistentAttentionBackend):
    """The project's attention as vLLM's ``CUSTOM`` backend on a device platform."""

    # The cache holds plain keys / values: vLLM's selector rejects an fp8 cache before the impl is built.
    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return DeviceAttentionImpl

    @staticmethod
    def get_builder_cls():
        return DeviceAttentionMetadataBuilder


_STOCK_HEAD_SIZES = tuple(CPUAttentionBackend.get_supported_head_sizes())


class StockAttentionMetadataBuilder(ConsistentAttentionMetadataBuilder):
    """vLLM-CPU's metadata for the head sizes its kernel has; the plain metadata otherwise."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> CPUAttentionMetadata:
        if self.head_dim in _STOCK_HEAD_SIZES:
            return CPUAttentionMetadataBuilder.build(self, common_prefix_len, common_attn_metadata, fast_build)
        return super().build(common_prefix_len, common_attn_metadata, fast_build)


class StockAttentionImpl(CPUAttentionBackendImpl):
    """Flag off: vLLM-CPU's own attention kernel. For head sizes its kernel lacks (the tiny
    models' 16) a serving engine's default instead -- one batched SDPA over the padded batch,
    whose numerics depend on the batch's shapes -- on the same unpacked paged cache."""

    def _plain(self) -> bool:
        return self.head_size not in _STOCK_HEAD_SIZES

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if not self._plain():
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        ConsistentAttentionImpl.do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if not self._plain() or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        n, seg, local, q_grid, q_positions, paged, kv_valid = _paged_layout(self, query, kv_cache, attn_metadata)
        keys, values = paged.gather()
        visible = kv_valid[:, None, :] & (torch.arange(keys.shape[2])[None, None, :] <= q_positions[:, :, None])
        visible[:, :, 0] |= q_positions < 0  # padding query rows see key 0 (their output is dropped)
        out = torch.nn.functional.scaled_dot_product_attention(
            q_grid.transpose(1, 2), keys.to(query.dtype), values.to(query.dtype), attn_mask=visible[:, None],
            scale=self.scale, enable_gqa=True,
        )
        rows = out.transpose(1, 2)[seg, local]
        output[:n].copy_(rows.reshape(output[:n].shape))
        return output


class StockAttentionBackend(CPUAttentionBackend):
    """vLLM-CPU's attention backend (flag off), admitting any head size (see StockAttentionImpl)."""

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(1, 1025))

    @staticmethod
    def get_impl_cls():
        return StockAttentionImpl

    @staticmethod
    def get_builder_cls():
        return StockAttentionMetadataBuilder
