"""Qwen3.5's hybrid decoder layers on the consistent ops (forwards :mod:`.patches` puts in place of
vLLM's): the gated full-attention layer (:func:`gated_attention_forward`) and the Gated DeltaNet
linear-attention layer (:func:`gdn_forward`)."""

from __future__ import annotations

import torch

from true_on_policy.kernels import gated_delta, ops
from true_on_policy.kernels.architectures import UnsupportedFeatureError


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
    """vLLM's ``QwenGatedDeltaNetAttention.forward_cpu`` (vLLM-CPU) and ``forward_cuda`` (CUDA) on
    :func:`gated_delta.gated_delta_net_slots`: one C++ call per part of a step on CPU, its torch code (the
    specification the C++ is held ``torch.equal`` to) on a device.

    The input projections (``in_proj_qkvz`` as q|k|v and z, ``in_proj_ba`` as b|a) and ``out_proj``
    run the consistent linears; the conv, gating, delta rule and gated norm run the one order-fixed
    op, in the recurrent order with an fp32 state, for prefill chunks and decode steps alike, so a
    token's bits do not depend on how the scheduler split its sequence (:func:`_gdn_step`). At TP > 1
    each rank holds whole heads (vLLM shards q, k, v, z, b, a, the conv channels, ``A_log`` and
    ``dt_bias`` by head; every op after the projections is per head), and ``out_proj`` is row-parallel
    through the consistent fixed tree: a token's bits are TP 1's.
    """
    if layer.gqa_interleaved_layout:
        raise UnsupportedFeatureError("true_on_policy (vLLM): Qwen3-Next's interleaved in_proj_qkvz is not covered")
    tp = layer.tp_size
    if layer.num_k_heads % tp or layer.num_v_heads % tp or (tp > 1 and layer.disable_tp_for_ba_proj):
        raise UnsupportedFeatureError(
            f"true_on_policy (vLLM): Gated DeltaNet at TP {tp} with {layer.num_k_heads} key / {layer.num_v_heads} value "
            f"heads{' and a replicated in_proj_ba' if layer.disable_tp_for_ba_proj else ''} is not covered (covered: "
            "head counts that divide by TP)"
        )
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
    key_dim, value_dim = layer.key_dim // tp, layer.value_dim // tp  # this rank's heads (column-parallel)
    mixed_qkv, z = mixed_qkvz.split([key_dim * 2 + value_dim, value_dim], dim=-1)
    b, a = ba.chunk(2, dim=-1)
    y = hidden_states.new_zeros(hidden_states.shape[0], value_dim)
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if metadata is not None:  # None: vLLM's warm-up / profile run, which has no state slots
        _gdn_step(layer, metadata[layer.prefix], mixed_qkv, z, b, a, y)
    output, _ = layer.out_proj(y)
    return output


def _gdn_step(layer, m, mixed_qkv, z, b, a, y) -> None:
    """One step's requests through the op in two calls, decodes then prefill chunks (vLLM's order): each request
    enters with its slot's conv and recurrent state (zeros where a prefill has none yet) and leaves its new
    state in the slot; ``y``'s rows of the step's tokens written. Two calls, because the op's torch code (a
    device's) pads a call's sequences to its longest: a decode beside a prefill chunk would step through the
    chunk's length. A token's bits do not depend on the grouping (each sequence runs alone in the op)."""
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
    decodes = m.num_decodes  # one token each: vLLM's decode threshold without speculative decoding
    for first, last, start, stop, prefill in ((0, decodes, 0, decodes, False), (decodes, requests, decodes, n, True)):
        if first == last:
            continue
        if prefill:
            fresh = ~m.has_initial_state[first:last].to(device=mixed_qkv.device, dtype=torch.bool)
        else:  # decodes continue their sequences
            fresh = torch.zeros(last - first, dtype=torch.bool, device=mixed_qkv.device)
        y[start:stop] = gated_delta.gated_delta_net_slots(
            mixed_qkv[start:stop], z[start:stop], a[start:stop], b[start:stop],
            cu_seqlens=bounds[first:last + 1] - start, slots=slots[first:last], fresh=fresh, conv_cache=conv_cache,
            state_cache=state_cache, conv_weight=layer.conv1d.weight,
            # transformers holds A_log in the model dtype; vLLM keeps it fp32: the training model's value
            A_log=layer.A_log.to(layer.dt_bias.dtype), dt_bias=layer.dt_bias, norm_weight=layer.norm.weight,
            head_k_dim=layer.head_k_dim, head_v_dim=layer.head_v_dim, eps=layer.norm.eps,
        )
