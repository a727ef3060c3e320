"""The training attention's memory (issue 57): its torch backward grows with the sequence, not with the pairs.

The torch backward (head dims above K_CHUNK, or without the native library) takes the (tile, block) pairs
``BACKWARD_PAIRS`` at a time. Bitwise: any step gives the whole-``P`` step's gradients (the backward it
replaced). Memory: the peak of what the backward allocates (the profiler's allocation events) at 2T is at
most ~2x that at T; the twin: the whole-``P`` step gathers keys, values and products per pair, ~4x.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from true_on_policy.kernels import ops
from true_on_policy.kernels.ops import block_attention


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def training_case(seed, S, Hq, Hkv, T, D, padded=False):
    """q, k, v [S, H, T, D] and the layout of T-token training rows (the second row shorter if ``padded``)."""
    g = gen(seed)
    q, k, v = (torch.randn(S, h, T, D, generator=g) for h in (Hq, Hkv, Hkv))
    lens = torch.full((S,), T)
    if padded:
        lens[-1] = T // 2 + 3
    q_pos = torch.where(torch.arange(T)[None] < lens[:, None], torch.arange(T)[None], -1)
    kv_valid = torch.arange(T)[None] < lens[:, None]
    return q, k, v, q_pos, kv_valid


def backward_inputs(seed, *shape, padded=False):
    """The torch backward's arguments, from the training forward's state (the route this process has)."""
    q, k, v, q_pos, kv_valid = training_case(seed, *shape, padded=padded)
    plan = ops.attention_plan(q_pos, kv_valid, q.shape[1], k.shape[1])
    _, state = block_attention._attention_forward(q, k, v, plan, 0.125, keep_for_backward=True)
    do = block_attention._heads_to_tiles(torch.randn(q.shape, generator=gen(seed + 1)), plan, plan.dims[8])
    delta = (do * state["out_tiles"]).sum(-1)
    operands = block_attention._torch_backward_operands(state, plan)
    return (do, delta, state["probs"], *operands, plan), plan.pair_t.numel()


def peak_bytes(fn) -> int:
    """The most bytes ``fn`` holds allocated at once: its CPU allocations and frees, in order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_the_torch_backward_in_steps_gives_the_whole_steps_bits():
    # head dims: within K_CHUNK (the fused backward's shapes) and above it (the torch backward's alone)
    for shape, padded in [((2, 4, 2, 200, 16), True), ((1, 8, 2, 300, 256), False), ((2, 4, 1, 130, 200), True)]:
        args, pairs = backward_inputs(3, *shape, padded=padded)
        for n_threads in (1, 2):
            previous = torch.get_num_threads()
            torch.set_num_threads(n_threads)
            try:
                whole = block_attention._torch_backward(*args, step=pairs)
                for step in (1, 7, block_attention.BACKWARD_PAIRS):
                    stepped = block_attention._torch_backward(*args, step=step)
                    for name, a, b in zip(("grad_q", "grad_k", "grad_v"), stepped, whole):
                        assert torch.equal(a, b), (shape, n_threads, step, name)
            finally:
                torch.set_num_threads(previous)


def _backward_peak(T: int) -> int:
    """Peak bytes of ops.attention's backward (head dim 200: the torch backward) for T training tokens."""
    q, k, v, q_pos, kv_valid = training_case(5, 1, 2, 1, T, 200)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = ops.attention(*leaves, q_pos, kv_valid, 0.125)
    grad_out = torch.randn(out.shape, generator=gen(6))
    return peak_bytes(lambda: out.backward(grad_out))


def test_the_backwards_peak_grows_linearly_in_the_sequence():
    small, large = _backward_peak(1024), _backward_peak(2048)
    assert large <= 2.5 * small, (small, large)


def test_twin_the_whole_step_backwards_peak_grows_with_the_pairs():
    """The backward this replaced (every pair's operands and products at once) grows ~4x from T to 2T."""
    peaks = []
    for T in (1024, 2048):
        args, pairs = backward_inputs(5, 1, 2, 1, T, 200)
        peaks.append(peak_bytes(lambda: block_attention._torch_backward(*args, step=pairs)))
    assert peaks[1] >= 3.5 * peaks[0], peaks
