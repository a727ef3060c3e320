"""vLLM's linear layers on :mod:`true_on_policy.kernels.ops` (plain functions :mod:`.patches` puts in
place of the linear method, the LM head, the row-parallel linear and the vocabulary-parallel embedding),
and the sampler's log-softmax on the LM head's logits.

* linear: one :func:`ops.linear` per projection of a fused layer (qkv, gate_up), on the unpacked
  weight, so each projection's bits are those of the training model's separate ``nn.Linear``; each
  projection's weight laid out once for its native path (:func:`.weight_packs.linear_packs`).
* Tensor parallelism (vLLM's own sharding, any TP a power of two <= ``ops.MAX_TP``): a column-parallel
  shard (qkv, gate_up, the vocabulary-parallel LM head) computes its features' bits and vLLM gathers
  them (the logits: all-gather, never a reduction); a row-parallel layer (:func:`row_parallel_forward`:
  o_proj, down_proj) runs the one row-parallel reduction of :mod:`true_on_policy.kernels.row_parallel`
  over vLLM's all-gather; the vocabulary-parallel embedding's all-reduce adds exact ``-0.0``
  (:func:`vocab_parallel_embedding_forward`). So every TP size computes the unsharded model's bits.
"""

from __future__ import annotations

import torch

from true_on_policy.kernels import ops, row_parallel
from true_on_policy.kernels.architectures import UnsupportedFeatureError
from true_on_policy.vllm_adapter.process_groups import gather, tp_group
from true_on_policy.vllm_adapter.weight_packs import linear_packs, weight_pack


def linear_apply(layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One :func:`ops.linear` per output partition (q, k, v / gate, up), concatenated, each reading its
    partition's pack (:func:`.weight_packs.linear_packs`)."""
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
    out = row_parallel.row_parallel_linear(x, layer.weight, bias, tp, gather(tp_group), pack=weight_pack(layer))
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

