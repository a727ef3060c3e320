"""Batch invariance of every consistent op (torch.equal), with twins showing the default op is not.

"Invariant" here: a row's bits do not depend on how many rows share the call, on the row's position
among them, on the sequence position a tile starts at, or on 1 vs 2 threads.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from true_on_policy.kernels import moe, ops
from kernel_helpers import gen, threads


def rows_in_batches(fn, row: torch.Tensor, sizes, seed: int = 0, thread_counts=(1, 2)):
    """Yield (label, fn-output-row) for ``row`` placed at several positions of batches of ``sizes``."""
    g = gen(seed)
    for n_threads in thread_counts:
        with threads(n_threads):
            for m in sizes:
                for where in sorted({0, m // 2, m - 1}):
                    batch = torch.randn(m, row.shape[-1], generator=g).to(row.dtype)
                    batch[where] = row
                    yield f"M={m} at {where} threads={n_threads}", fn(batch)[where]


# ----------------------------------------------------------------------------------------------
# the switch
# ----------------------------------------------------------------------------------------------


def test_switch_is_one_flag_and_context_manager_restores():
    previous = ops.switches()
    try:
        ops.set_switches(consistent=False)
        assert not ops.enabled()
        with ops.consistent():
            assert ops.enabled()
            with ops.consistent(False):
                assert not ops.enabled()
            assert ops.enabled()
        assert not ops.enabled()
        ops.set_switches(consistent=True)
        assert ops.enabled()
    finally:
        ops.set_switches(consistent=previous.consistent)


# ----------------------------------------------------------------------------------------------
# linear
# ----------------------------------------------------------------------------------------------

LINEAR_SIZES = (1, 2, 3, 5, 8, 13, 31, 64, 65, 200)


@pytest.mark.parametrize("k", [16, 64, 128, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_row_is_batch_invariant(k, dtype):
    g = gen(k)
    weight = torch.randn(96, k, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    row = torch.randn(k, generator=g).to(dtype)
    with threads(1):
        reference = ops.linear(row[None], weight, bias)[0]
    sizes = LINEAR_SIZES if dtype == torch.float32 else (1, 7, 64, 65)
    for label, out in rows_in_batches(lambda x: ops.linear(x, weight, bias), row, sizes, seed=k):
        assert torch.equal(out, reference), label
    assert reference.dtype == dtype


def test_linear_twin_default_f_linear_is_batch_variant():
    """The problem without the fix: F.linear gives a row different bits depending on M."""
    g = gen(1)
    weight = torch.randn(128, 1024, generator=g)
    x = torch.randn(64, 1024, generator=g)
    alone = F.linear(x[:1], weight)[0]
    variant = [m for m in range(2, 64) if not torch.equal(F.linear(x[:m], weight)[0], alone)]
    assert variant, "F.linear was batch-invariant here: the twin lost its point"
    assert all(torch.equal(ops.linear(x[:m], weight)[0], ops.linear(x[:1], weight)[0]) for m in variant)


def test_linear_matches_f_linear_and_leading_dims_and_out_dtype():
    g = gen(2)
    x = torch.randn(3, 5, 64, generator=g)
    weight, bias = torch.randn(40, 64, generator=g), torch.randn(40, generator=g)
    out = ops.linear(x, weight, bias)
    assert out.shape == (3, 5, 40)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    xb = x.bfloat16()
    assert ops.linear(xb, weight.bfloat16()).dtype == torch.bfloat16
    assert ops.linear(xb, weight.bfloat16(), out_dtype=torch.float32).dtype == torch.float32
    assert ops.linear(x[:0], weight).shape == (0, 5, 40)


def test_linear_backward_matches_f_linear():
    g = gen(3)
    x = torch.randn(37, 64, generator=g, requires_grad=True)
    weight = torch.randn(24, 64, generator=g, requires_grad=True)
    bias = torch.randn(24, generator=g, requires_grad=True)
    upstream = torch.randn(37, 24, generator=g)
    ops.linear(x, weight, bias).backward(upstream)
    got = [t.grad.clone() for t in (x, weight, bias)]
    for t in (x, weight, bias):
        t.grad = None
    F.linear(x, weight, bias).backward(upstream)
    for mine, ref in zip(got, (x.grad, weight.grad, bias.grad)):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4)


def test_linear_ignores_autocast():
    g = gen(4)
    x, weight = torch.randn(9, 64, generator=g), torch.randn(32, 64, generator=g)
    plain = ops.linear(x, weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = ops.linear(x, weight)
    assert inside.dtype == torch.float32 and torch.equal(inside, plain)


# ----------------------------------------------------------------------------------------------
# reductions and elementwise ops
# ----------------------------------------------------------------------------------------------


def test_fixed_sum_is_a_fixed_tree():
    g = gen(5)
    x = torch.randn(7, 100, generator=g)
    s = ops.fixed_sum(x)
    assert s.shape == (7, 1)
    torch.testing.assert_close(s, x.sum(-1, keepdim=True), rtol=1e-5, atol=1e-5)
    for label, out in rows_in_batches(ops.fixed_sum, x[3], (1, 2, 9, 100)):
        assert torch.equal(out, s[3]), label


def _tree_through_autograd(x):
    """fixed_sum's tree written out with torch ops: the gradient autograd derives through it."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    x = F.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x


def _gradients(sum_fn, x, grad_out):
    leaf = x.clone().requires_grad_()
    out = sum_fn(leaf)
    out.backward(grad_out)
    return out.detach(), leaf.grad


def _signed_zero_and_nan_grads(g, shape, dtype):
    grad_out = torch.randn(*shape[:-1], 1, generator=g).to(dtype)
    grad_out.view(-1)[::3] = -0.0  # autograd's tree turns these into +0.0
    grad_out.view(-1)[1::4] = math.nan
    return grad_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_sum_gradient_is_autograds_through_the_tree(dtype):
    """One autograd node (forward and backward) with the bits of the tree's ~4 nodes per level: every
    value and the sign of every zero; NaN stays NaN (torch's bf16 adds do not keep NaN payloads)."""
    g = gen(15)
    for shape in [(5, 1), (5, 2), (3, 7), (4, 64), (2, 3, 100), (300, 128)]:
        x = torch.randn(shape, generator=g).to(dtype)
        grad_out = _signed_zero_and_nan_grads(g, shape, dtype)
        (out, grad), (ref_out, ref_grad) = _gradients(ops.fixed_sum, x, grad_out), _gradients(
            _tree_through_autograd, x, grad_out
        )
        assert torch.equal(out, ref_out), shape
        nan = ref_grad.isnan()
        assert torch.equal(grad.isnan(), nan), shape
        assert torch.equal(grad[~nan], ref_grad[~nan]), shape
        assert torch.equal(grad[~nan].signbit(), ref_grad[~nan].signbit()), shape


def test_twin_the_trees_gradient_is_not_the_output_gradient_as_is():
    """Why _FixedSum's backward adds 0.0: handing the gradient on unchanged keeps a -0.0 that autograd's
    tree makes +0.0 (torch.equal calls the two equal: the sign bit shows it)."""
    g = gen(16)
    x = torch.randn(4, 64, generator=g)
    grad_out = _signed_zero_and_nan_grads(g, x.shape, torch.float32).nan_to_num(0.5)
    _, tree_grad = _gradients(_tree_through_autograd, x, grad_out)
    as_is = grad_out.expand(x.shape)
    assert torch.equal(as_is, tree_grad)
    assert not torch.equal(as_is.signbit(), tree_grad.signbit())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_batch_invariant_and_matches_hf(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = gen(6)
    hf = Qwen3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64, generator=g))
    hf = hf.to(dtype)
    row = torch.randn(64, generator=g).to(dtype)
    with threads(1):
        reference = ops.rms_norm(row[None], hf.weight, 1e-6)[0]
    for label, out in rows_in_batches(lambda x: ops.rms_norm(x, hf.weight, 1e-6), row, (1, 2, 3, 17, 300)):
        assert torch.equal(out, reference), label
    x = torch.randn(5, 64, generator=g).to(dtype)
    mine = ops.rms_norm(x, hf.weight, 1e-6)
    assert mine.dtype == hf(x).dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(mine, hf(x), rtol=tol, atol=tol)


def _tail_variant(fn, x):
    """Offsets s where fn(x[s:]) is not fn(x)[s:] (the vectorised loop's tail moves)."""
    full = fn(x)
    return [s for s in range(1, 40) if not torch.equal(fn(x[s:]), full[s:])]


def test_silu_is_position_invariant_and_close_to_f_silu():
    x = torch.randn(2003, generator=gen(7)) * 4
    assert _tail_variant(ops.silu, x) == []
    with threads(1):
        one = ops.silu(x)
    with threads(2):
        assert torch.equal(ops.silu(x), one)
    torch.testing.assert_close(ops.silu(x), F.silu(x), rtol=1e-6, atol=1e-6)
    xb = x.bfloat16()
    assert ops.silu(xb).dtype == torch.bfloat16 and _tail_variant(ops.silu, xb) == []


def test_silu_twin_default_f_silu_is_position_variant():
    """The problem without the fix: F.silu's bits depend on where an element sits in the tensor."""
    x = torch.randn(2003, generator=gen(7)) * 4
    variant = _tail_variant(F.silu, x)
    assert variant, "F.silu was position-invariant here: the twin lost its point"
    assert all(torch.equal(ops.silu(x[s:]), ops.silu(x)[s:]) for s in variant)  # the fix, at the same offsets


def test_rope_table_matches_hf_and_apply_rope_is_elementwise():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    from true_on_policy.tiny_assets import tiny_model_config

    config = tiny_model_config("dense")
    cos, sin = ops.rope_table(config)
    assert cos.shape == (config.max_position_embeddings, config.head_dim) and cos.dtype == torch.float32
    hf = Qwen3RotaryEmbedding(config)
    positions = torch.arange(0, config.max_position_embeddings, 7)[None]
    hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(cos[positions], hf_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[positions], hf_sin, rtol=1e-5, atol=1e-5)
    g = gen(8)
    q = torch.randn(1, 4, positions.shape[1], 16, generator=g)
    k = torch.randn(1, 2, positions.shape[1], 16, generator=g)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    torch.testing.assert_close(ops.apply_rope(q, cos[positions], sin[positions]), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.apply_rope(k, cos[positions], sin[positions]), ref_k, rtol=1e-5, atol=1e-5)
    # one position's rotation does not depend on the others computed with it
    one = ops.apply_rope(q[:, :, 5:6], cos[positions[:, 5:6]], sin[positions[:, 5:6]])
    assert torch.equal(one, ops.apply_rope(q, cos[positions], sin[positions])[:, :, 5:6])


def test_rope_table_rejects_unknown_rope_types():
    from true_on_policy.tiny_assets import tiny_model_config

    config = tiny_model_config("dense")
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(NotImplementedError, match="yarn"):
        ops.rope_table(config)


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------


def _qkv(seed, S, T, dtype=torch.float32, hq=4, hkv=2, d=16):
    g = gen(seed)
    return tuple(torch.randn(S, h, T, d, generator=g).to(dtype) for h in (hq, hkv, hkv))


def _full(q, k, v, lens):
    S, _, T, _ = q.shape
    valid = torch.arange(T)[None] < torch.tensor(lens)[:, None]
    return ops.attention(q, k, v, torch.where(valid, torch.arange(T), -1), valid, 0.25)


def test_attention_matches_sdpa():
    q, k, v = _qkv(10, 3, 150)
    lens = [150, 97, 5]
    out = _full(q, k, v, lens)
    for s, n in enumerate(lens):
        ref = F.scaled_dot_product_attention(q[s : s + 1, :, :n], k[s : s + 1, :, :n], v[s : s + 1, :, :n],
                                             is_causal=True, scale=0.25, enable_gqa=True)
        torch.testing.assert_close(out[s : s + 1, :, :n], ref, rtol=1e-5, atol=1e-5)
        assert torch.count_nonzero(out[s, :, n:]) == 0  # padding query rows are exactly 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_decode_row_equals_training_row(dtype):
    """One query over a cache (garbage past its end) == that row of the full-sequence forward."""
    q, k, v = _qkv(11, 2, 200, dtype)
    full = _full(q, k, v, [200, 130])
    for s, n in ((0, 200), (1, 130)):
        for p in sorted({0, 1, 31, 63, 64, 65, 127, 128, n - 1}):
            kv_len = p + 1 + 9  # nine slots of garbage after the last real key
            kk = torch.full((1, 2, kv_len, 16), float("nan")).to(dtype)
            vv = torch.full((1, 2, kv_len, 16), float("inf")).to(dtype)
            kk[:, :, : p + 1], vv[:, :, : p + 1] = k[s : s + 1, :, : p + 1], v[s : s + 1, :, : p + 1]
            valid = torch.arange(kv_len)[None] <= p
            one = ops.attention(q[s : s + 1, :, p : p + 1], kk, vv, torch.tensor([[p]]), valid, 0.25)
            assert torch.equal(one[0, :, 0], full[s, :, p]), (s, p)


def test_attention_row_is_invariant_to_batch_composition_threads_and_prefill_chunks():
    q, k, v = _qkv(12, 1, 190)
    with threads(1):
        alone = _full(q, k, v, [190])[0]
    q2, k2, v2 = _qkv(13, 4, 300)
    for n_threads in (1, 2):
        with threads(n_threads):
            for slot in (0, 3):
                qb, kb, vb = q2.clone(), k2.clone(), v2.clone()
                qb[slot, :, :190], kb[slot, :, :190], vb[slot, :, :190] = q[0], k[0], v[0]
                lens = [300, 17, 250, 64]
                lens[slot] = 190
                assert torch.equal(_full(qb, kb, vb, lens)[slot, :, :190], alone), (n_threads, slot)
    # chunked prefill: queries 100..189 against keys 0..189 (positions as given)
    pos = torch.arange(100, 190)[None]
    chunk = ops.attention(q[:, :, 100:190], k, v, pos, torch.ones(1, 190, dtype=torch.bool), 0.25)
    assert torch.equal(chunk[0], alone[:, 100:190])


def test_attention_masked_garbage_does_not_leak():
    q, k, v = _qkv(14, 2, 130)
    clean = _full(q, k, v, [130, 70])
    q[1, :, 70:], k[1, :, 70:], v[1, :, 70:] = float("nan"), float("inf"), float("nan")
    dirty = _full(q, k, v, [130, 70])
    assert torch.equal(dirty[:, :, :70], clean[:, :, :70]) and torch.equal(dirty[0], clean[0])
    assert torch.count_nonzero(dirty[1, :, 70:]) == 0


def test_attention_plan_reuse_and_backward_matches_sdpa():
    q, k, v = (t.requires_grad_() for t in _qkv(15, 1, 140))
    valid = torch.ones(1, 140, dtype=torch.bool)
    plan = ops.attention_plan(torch.arange(140)[None], valid, 4, 2)
    out = ops.attention(q, k, v, None, None, 0.25, plan=plan)
    upstream = torch.randn(out.shape, generator=gen(16))
    out.backward(upstream)
    mine = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    ref.backward(upstream)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(mine, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_attention_twin_default_sdpa_decode_differs_from_full():
    """The problem without the fix: SDPA of one query over the cache vs the full causal forward."""
    q, k, v = _qkv(17, 1, 300)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    differ = [p for p in range(0, 300, 13)
              if not torch.equal(F.scaled_dot_product_attention(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1],
                                                                enable_gqa=True)[0, :, 0], full[0, :, p])]
    assert differ, "SDPA decode matched the full forward here: the twin lost its point"
    ours = _full(q, k, v, [300])[0]  # the fix, at the same positions: the decode row is the full row
    for p in differ:
        one = ops.attention(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1], torch.tensor([[p]]),
                            torch.ones(1, p + 1, dtype=torch.bool), 0.25)
        assert torch.equal(one[0, :, 0], ours[:, p]), p


def test_softmax_twin_block_split_changes_bits():
    """Rule 3's reason: the same scores reduced with another KV split (flash-decoding style) differ
    from torch.softmax over the whole row -- so both engines must use the same block cadence."""
    g = gen(18)
    scores, values = torch.randn(64, 256, generator=g) * 3, torch.randn(256, 16, generator=g)
    whole = torch.softmax(scores, -1) @ values
    halves = []
    for part in (scores[:, :128], scores[:, 128:]):
        m = part.amax(-1, keepdim=True)
        e = torch.exp(part - m)
        halves.append((m, e.sum(-1, keepdim=True), e @ (values[:128] if len(halves) == 0 else values[128:])))
    (m1, l1, a1), (m2, l2, a2) = halves
    m = torch.maximum(m1, m2)
    split = (a1 * torch.exp(m1 - m) + a2 * torch.exp(m2 - m)) / (l1 * torch.exp(m1 - m) + l2 * torch.exp(m2 - m))
    assert not torch.equal(split, whole)
    torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# MoE and log-probs
# ----------------------------------------------------------------------------------------------


def test_moe_route_stable_ties_and_normalisation():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0], [0.5, -1.0, 4.0, 0.5]])
    weights, experts = moe.moe_route(logits, 2, norm_topk_prob=True)
    assert experts.tolist() == [[1, 2], [0, 1], [2, 0]]
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(3))
    probs = torch.softmax(logits, -1)
    raw, _ = moe.moe_route(logits, 2, norm_topk_prob=False)
    torch.testing.assert_close(raw, probs.gather(-1, experts))
    g = gen(19)
    batch = torch.randn(50, 8, generator=g).bfloat16()
    w_all, e_all = moe.moe_route(batch, 2, True)
    for i in (0, 17, 49):
        w_one, e_one = moe.moe_route(batch[i : i + 1], 2, True)
        assert torch.equal(w_one[0], w_all[i]) and torch.equal(e_one[0], e_all[i])


def test_moe_combine_fixed_order_fp32():
    g = gen(20)
    outputs, weights = torch.randn(6, 3, 8, generator=g).bfloat16(), torch.rand(6, 3, generator=g)
    combined = moe.moe_combine(outputs, weights)
    assert combined.dtype == torch.float32
    manual = outputs[:, 0].float() * weights[:, 0, None]
    manual = manual + outputs[:, 1].float() * weights[:, 1, None]
    manual = manual + outputs[:, 2].float() * weights[:, 2, None]
    assert torch.equal(combined, manual)
    assert torch.equal(moe.moe_combine(outputs[2:3], weights[2:3])[0], combined[2])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_log_probs_invariant_and_correct(temperature):
    g = gen(21)
    logits = torch.randn(40, 1000, generator=g) * 5
    labels = torch.randint(0, 1000, (40,), generator=g)
    lp = ops.token_log_probs(logits, labels, temperature)
    ref = torch.log_softmax(logits / temperature, -1).gather(-1, labels[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
    for n_threads in (1, 2):
        with threads(n_threads):
            for i in (0, 13, 39):
                assert torch.equal(ops.token_log_probs(logits[i : i + 1], labels[i : i + 1], temperature)[0], lp[i])
    full = ops.log_softmax(logits, temperature)
    assert full.dtype == torch.float32 and torch.equal(full.gather(-1, labels[:, None])[:, 0], lp)
    assert ops.token_log_probs(logits.bfloat16(), labels).dtype == torch.float32
    assert ops.token_log_probs(logits.view(4, 10, 1000), labels.view(4, 10)).shape == (4, 10)
    assert math.isfinite(float(ops.token_log_probs(logits, labels).sum()))


# --- the diagnosis tool's fault switches act on these kernels, and only when switched on ------------------


def test_fault_switches_change_the_real_kernels_and_are_off_by_default():
    torch.manual_seed(0)
    S, Hq, Hkv, T, D = 2, 4, 2, 100, 16
    q, k, v = torch.randn(S, Hq, T, D), torch.randn(S, Hkv, T, D), torch.randn(S, Hkv, T, D)
    positions = torch.arange(T).expand(S, T).clone()
    kv_valid = torch.ones(S, T, dtype=torch.bool)
    kv_valid[1, 70:] = False  # a shorter second sequence: unwritten slots
    positions[1, 70:] = -1

    def run(fault=None):
        if fault is None:
            return ops.attention(q, k, v, positions, kv_valid, 0.25)
        with ops.switched(fault=fault):
            return ops.attention(q, k, v, positions, kv_valid, 0.25)

    reference = run()
    assert torch.equal(run(ops.Fault()), reference)  # all switches off: every bit unchanged
    assert torch.equal(run(ops.Fault(kv_garbage=True)), reference)  # selection keeps NaN garbage out (rule 1)
    assert not torch.equal(run(ops.Fault(softmax_dtype=torch.bfloat16)), reference)  # rule 4 broken
    assert not bool(torch.isfinite(run(ops.Fault(additive_mask=True, kv_garbage=True))).all())  # rule 1 broken
    assert torch.equal(run(), reference)  # the context restored the switches

    logits = torch.tensor([[0.0, 0.0, -1.0, 2.0]])  # experts 0 and 1 tie behind expert 3
    _, experts = moe.moe_route(logits, 2, True)
    with ops.switched(fault=ops.Fault(router_ties_to_higher=True)):
        _, reversed_experts = moe.moe_route(logits, 2, True)
    assert experts.tolist() == [[3, 0]] and reversed_experts.tolist() == [[3, 1]]


def test_fault_switches_refuse_the_training_path():
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    positions, kv_valid = torch.arange(8)[None], torch.ones(1, 8, dtype=torch.bool)
    with ops.switched(fault=ops.Fault(softmax_dtype=torch.bfloat16)), pytest.raises(RuntimeError, match="forward-only"):
        ops.attention(q, k, v, positions, kv_valid, 0.5)
