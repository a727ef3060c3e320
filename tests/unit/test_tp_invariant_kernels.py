"""The consistent linear and MoE kernels give the same bits at every tensor / expert parallel size.

A row-parallel shard's :func:`ops.linear` (``k_parts``) is a complete subtree of the unsharded
reduction tree, so the shards' fp32 subtrees combined by :func:`ops.tree_combine` are bitwise the
unsharded linear at TP 1, 2, 4 and 8; a column-parallel shard computes its own output features'
bits; an expert-TP shard of the experts and an EP rank's slots combine to the unsharded experts.
Checked on both code paths (the C++ fast path and the torch specification), in one process and
over 4 real gloo ranks. Each guarantee has its twin: the previous order (K chunks left to right,
the ranks' partials added), a narrow shard without its zero features, and an EP combine that adds
each rank's weighted partial sum all give other bits.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist

from kernel_helpers import premise_skip, spawn_ranks
from true_on_policy.kernels import moe, ops
from true_on_policy.kernels import tensor_parallel

PATHS = {"native": contextlib.nullcontext, "torch": functools.partial(ops.switched, native=False)}
SHAPES = [  # (rows, K, N): decode and training rows, K with and without chunked leaves, narrow N
    (1, 64, 24), (5, 128, 64), (64, 192, 40), (130, 200, 17), (3, 1048, 32), (65, 4096, 12), (2, 48, 3), (70, 24, 96),
]


def _inputs(m, k, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype)
    return x, w, b


def _row_parallel(x, w, b, t, out_dtype):
    """TP = t in one process: each shard's subtree, the tree's top over the shards, then the epilogue."""
    k = x.shape[-1] // t
    parts = [ops.linear(x[:, r * k : (r + 1) * k], w[:, r * k : (r + 1) * k], None, torch.float32, k_parts=t)
             for r in range(t)]
    return ops.linear_epilogue(ops.tree_combine(parts), b, out_dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_parallel_shards_give_the_unsharded_bits_at_tp_1_2_4_8(path, dtype):
    with PATHS[path](), torch.no_grad():
        for i, (m, k, n) in enumerate(SHAPES):
            x, w, b = _inputs(m, k, n, dtype, seed=i)
            full = ops.linear(x, w, b)
            for t in (1, 2, 4, 8):
                if k % t == 0:
                    assert torch.equal(_row_parallel(x, w, b, t, dtype), full), (m, k, n, t)


@pytest.mark.parametrize("path", PATHS)
def test_column_parallel_shards_compute_their_features_bits(path):
    """Any slice of output features (1..N wide, at any offset) is the same bits as in the full product."""
    with PATHS[path](), torch.no_grad():
        for m in (1, 4, 64, 70):
            x, w, b = _inputs(m, 64, 130, torch.bfloat16, seed=m)
            full = ops.linear(x, w, b, out_dtype=torch.float32)
            for lo, hi in [(0, 1), (5, 8), (0, 11), (64, 76), (1, 130), (100, 130), (0, 65), (65, 130)]:
                assert torch.equal(ops.linear(x, w[lo:hi], b[lo:hi], out_dtype=torch.float32), full[:, lo:hi]), (m, lo, hi)


def test_twin_the_previous_chunk_order_is_not_tp_invariant():
    """The reduction as it was: K in 128-wide chunks added left to right. Split at TP = 2, each rank's
    chunks and then the two partials are another addition order; the tree's subtrees are not."""
    x, w, _ = _inputs(64, 4096, 64, torch.float32, seed=7)
    a, bt = x[None], w.t()[None]
    previous_tp1 = ops.matmul_tiles(a, bt)
    previous_tp2 = ops.matmul_tiles(a[..., :2048], bt[:, :2048]) + ops.matmul_tiles(a[..., 2048:], bt[:, 2048:])
    assert not torch.equal(previous_tp1, previous_tp2)
    assert torch.equal(_row_parallel(x, w, None, 2, torch.float32), ops.linear(x, w, out_dtype=torch.float32))
    x, w, _ = _inputs(64, 64, 64, torch.float32, seed=8)  # the tiny models' K: one chunk unsharded, two at TP 2
    assert not torch.equal(torch.bmm(x[None], w.t()[None]), torch.bmm(x[None, :, :32], w.t()[None, :32]) +
                           torch.bmm(x[None, :, 32:], w.t()[None, 32:]))


def test_a_narrow_shard_computes_the_wide_products_columns():
    """A shard of fewer than 12 output features (a router of 4 experts, a 2-way split) gets its columns' bits
    in the wide product: zero features appended to FMA_CHAIN_MIN_N, on any CPU."""
    x, w, _ = _inputs(64, 64, 24, torch.float32, seed=9)
    wide = ops.linear(x, w, out_dtype=torch.float32)
    for n in range(1, 12):
        assert torch.equal(ops.linear(x, w[:n], out_dtype=torch.float32), wide[:, :n]), n


def test_twin_a_narrow_shard_without_zero_features_is_another_kernel():
    """Why fewer than 12 output features get zero features appended: MKL's narrow-product kernel gives those
    columns other bits than the wide product, for some shapes of the CPU it runs on (searched: the case
    first found on AMD first)."""
    tried = [(n, m, seed) for seed in (9, 10, 11, 12) for m in (64, 5, 1) for n in (4, *range(1, 4), *range(5, 12))]
    for n, m, seed in tried:
        x, w, _ = _inputs(m, 64, 24, torch.float32, seed=seed)
        wide = ops.linear(x, w, out_dtype=torch.float32)
        with ops.switched(native=False), torch.no_grad():
            unpadded = ops._padded_linear_forward(x, w[:n], None, torch.float32, ops.k_leaves(64))  # noqa: SLF001
        if not torch.equal(unpadded, wide[:, :n]):
            return
    premise_skip("mkl_narrow_kernel", f"an unpadded shard kept the wide product's bits in all {len(tried)} "
                                      "(n, rows, seed) tried")


def test_leaves_are_a_function_of_the_unsharded_k():
    assert [ops.k_leaves(k) for k in (1, 24, 37, 64, 128, 200, 300, 1048, 2048, 4096, 11008)] == [
        1, 8, 1, 8, 8, 8, 4, 8, 16, 32, 128
    ]
    for k in (64, 200, 4096, 1048):
        for t in (2, 4, 8):
            assert ops.local_leaves(k // t, t) * t == ops.k_leaves(k)


def test_unsupported_splits_are_refused_by_name():
    x, w, _ = _inputs(4, 64, 16, torch.float32, seed=1)
    for parts in (16, 3, 0):
        with pytest.raises(ValueError, match=f"k_parts={parts}.*MAX_TP=8"):
            ops.linear(x, w, k_parts=parts)
    from true_on_policy.tiny_assets import tiny_model_config

    dense, moe = tiny_model_config("dense"), tiny_model_config("moe")
    tensor_parallel.check_sharding(dense, 2)
    tensor_parallel.check_sharding(moe, 2, 2)
    hybrid = tiny_model_config("qwen35").to_dict()  # Gated DeltaNet 2 key / 4 value heads
    tensor_parallel.check_sharding(hybrid, 2)
    odd_gdn = {**hybrid, "linear_num_key_heads": 3, "linear_num_value_heads": 6}  # attention heads still divide
    for config, tp_size, ep_size, message in [
        (dense, 16, 1, "tensor_parallel_size=16 is not supported.*MAX_TP=8"),
        (dense, 3, 1, "tensor_parallel_size=3 is not supported"),
        (dense, 4, 1, "num_key_value_heads=2 does not divide by tensor_parallel_size=4"),
        (moe, 2, 8, "num_local_experts=4 does not divide by expert_parallel_size=8"),
        (dense, 2, 2, "expert_parallel_size=2 for a model without experts"),
        (odd_gdn, 2, 1, "linear_num_key_heads=3 does not divide by tensor_parallel_size=2"),
    ]:
        with pytest.raises(ValueError, match=message):
            tensor_parallel.check_sharding(config, tp_size, ep_size)


# ----------------------------------------------------------------------------------------------
# MoE: expert tensor parallelism and expert parallelism
# ----------------------------------------------------------------------------------------------


def _moe_case(dtype, tokens=37, experts=8, top_k=3, hidden=64, inter=48, seed=3):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(dtype)
    weights, chosen = moe.moe_route(torch.randn(tokens, experts, generator=g), top_k, True)
    return h, gate_up, down, weights, chosen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_tp_shards_give_the_unsharded_experts(dtype):
    h, gate_up, down, weights, chosen = _moe_case(dtype)
    inter = down.shape[-1]
    full = moe.moe_experts(h, chosen, gate_up, down)
    for t in (2, 4, 8):
        s = inter // t
        shards = []
        for r in range(t):  # vLLM's layout of a shard: its gate rows, then its up rows; its down columns
            gu = torch.cat([gate_up[:, r * s : (r + 1) * s], gate_up[:, inter + r * s : inter + (r + 1) * s]], dim=1)
            shards.append((gu, down[:, :, r * s : (r + 1) * s]))
        partials = []  # what the all-gather returns: every shard's fp32 partial, in shard order

        def record(partial, t=t):
            partials.append(partial)
            return [partial] * t  # this first pass only records the partials

        for gu, dn in shards:
            moe.moe_experts(h, chosen, gu, dn, k_parts=t, gather=record)
        results = [moe.moe_experts(h, chosen, gu, dn, k_parts=t, gather=lambda p: partials) for gu, dn in shards]
        for result in results:
            assert torch.equal(result, full), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_expert_tp_shards_give_the_unsharded_shared_expert(dtype):
    """Qwen3.5-MoE's shared expert at TP 2 and 4 (vLLM's layout: merged gate_up column shards, down row shards):
    each rank's result, its down projection folded over the gathered fp32 subtrees, is the unsharded bits. The
    twin: a shard run as if whole (no fold, the ranks' outputs summed) -- what the vLLM adapter did at TP 2 before,
    0.025 max |delta log-prob| on the tiny Qwen3.5-MoE -- differs."""
    h, gate_up, down, _, _ = _moe_case(dtype)
    gate_up, down = gate_up[0], down[0]  # one expert's shapes: [2I, H], [H, I]
    gate_weight = (torch.randn(1, h.shape[1], generator=torch.Generator().manual_seed(9)) * 0.1).to(dtype)
    inter = down.shape[-1]
    full = moe.shared_expert(h, gate_up, down, gate_weight)
    for t in (2, 4):
        s = inter // t
        shards = [(torch.cat([gate_up[r * s : (r + 1) * s], gate_up[inter + r * s : inter + (r + 1) * s]]),
                   down[:, r * s : (r + 1) * s]) for r in range(t)]
        partials = [ops.linear(ops.silu_mul(*ops.linear(h, gu).chunk(2, dim=-1)), dn, None, torch.float32, k_parts=t)
                    for gu, dn in shards]  # what the all-gather returns: every rank's fp32 subtree, in rank order
        for gu, dn in shards:
            assert torch.equal(moe.shared_expert(h, gu, dn, gate_weight, k_parts=t, gather=lambda p: partials), full)
        as_if_whole = sum(moe.shared_expert(h, gu, dn, gate_weight).float() for gu, dn in shards).to(dtype)
        assert not torch.equal(as_if_whole, full), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_parallel_selection_gives_the_unsharded_combine(dtype):
    h, gate_up, down, weights, chosen = _moe_case(dtype)
    full = moe.moe_combine(moe.moe_experts(h, chosen, gate_up, down), weights)
    for ep in (2, 4, 8):
        n = len(gate_up) // ep
        per_rank = [moe.moe_experts(h, chosen, gate_up[r * n : (r + 1) * n], down[r * n : (r + 1) * n],
                                    experts=range(r * n, (r + 1) * n)) for r in range(ep)]
        assert torch.equal(moe.moe_combine(moe.moe_select(per_rank, chosen // n), weights), full), ep


def test_twin_adding_the_ranks_weighted_partial_sums_is_another_order():
    """The previous EP combine: each rank's slot-order sum with other ranks' slots as exact zeros,
    then the ranks' sums added. With top-3 over 2 ranks a token whose slots 0 and 2 live on one rank
    gets (w0 y0 + w2 y2) + w1 y1 instead of (w0 y0 + w1 y1) + w2 y2."""
    h, gate_up, down, weights, chosen = _moe_case(torch.float32, tokens=200)
    per_slot = moe.moe_experts(h, chosen, gate_up, down)
    full = moe.moe_combine(per_slot, weights)
    owner = chosen // 4
    partials = [moe.moe_combine(torch.where((owner == r)[..., None], per_slot, 0.0), torch.where(owner == r, weights, 0.0))
                for r in (0, 1)]
    assert not torch.equal(partials[0] + partials[1], full)


# ----------------------------------------------------------------------------------------------
# 4 real gloo ranks: TP 4, and TP 2 in two subgroups
# ----------------------------------------------------------------------------------------------

WORLD = 4


def _worker(rank: int) -> dict:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {}
    for i, (m, k, n) in enumerate(SHAPES):
        x, w, b = _inputs(m, k, n, torch.bfloat16, seed=i)
        for t, group in ((4, None), (2, pairs[rank // 2])):
            r = dist.get_rank(group)
            shard = slice(r * k // t, (r + 1) * k // t)
            partial = ops.linear(x[:, shard], w[:, shard], None, torch.float32, k_parts=t)
            results[i, t] = ops.linear_epilogue(tensor_parallel.tree_all_reduce(partial, group), b, torch.float32)
        # the twin: the previous per-rank chunk order, then gloo's all_reduce of the partials
        shard = slice(rank * k // WORLD, (rank + 1) * k // WORLD)
        plain = ops.matmul_tiles(x[None, :, shard].float(), w[:, shard].float().t()[None])[0]
        dist.all_reduce(plain)
        results[i, "previous"] = plain + b.float()
    return results


@pytest.fixture(scope="module")
def gloo_ranks(tmp_path_factory):
    return spawn_ranks(_worker, WORLD, tmp_path_factory.mktemp("tp4"))


def test_gloo_tp4_and_tp2_give_the_unsharded_bits_on_every_rank(gloo_ranks):
    previous_differs = 0
    for i, (m, k, n) in enumerate(SHAPES):
        x, w, b = _inputs(m, k, n, torch.bfloat16, seed=i)
        full = ops.linear(x, w, b, out_dtype=torch.float32)
        for rank in gloo_ranks:
            for t in (4, 2):
                assert torch.equal(rank[i, t], full), (m, k, n, t)
        previous_differs += not torch.equal(gloo_ranks[0][i, "previous"], full)
    assert previous_differs >= len(SHAPES) // 2, previous_differs  # the twin: most shapes change bits
