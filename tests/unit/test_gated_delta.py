"""The consistent Gated DeltaNet (``kernels/gated_delta.py``): a token's bits do not depend on the split.

Bitwise (``torch.equal``): the layer on a full sequence == the same sequence split as prefix +
continuation, in chunks of 1/7/64/100 tokens; alone == in a right-padded batch with other lengths;
1 == 2 threads; the C++ core == the torch specification; the serving step over state slots in one C++ call
== the torch code. Close (not bitwise, by design): the
specification's autograd gradient and the layer's forward vs transformers' references. Twins: the
stock torch paths of transformers (chunked prefill vs recurrent decode, or a chunked prefix +
continuation) give other bits for the same tokens, on inputs found here; torch's sigmoid and softplus
kernels give other bits for the same value at another position (why the op builds them from exp/log).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from kernel_helpers import threads
from true_on_policy.kernels import gated_delta, native, ops

HK, HV, DK, DV, TAPS, STEPS = 2, 4, 16, 8, 4, 130
SPLITS = {"prefix+continuation": [53, 77], "chunks of 1": [1] * STEPS, "chunks of 7": [7] * 18 + [4],
          "chunks of 64": [64, 64, 2], "chunks of 100": [100, 30]}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def layer_weights(dtype, seed=0, dk=DK):
    g = gen(seed)
    channels = 2 * HK * dk + HV * DV
    return {"conv_weight": (torch.randn(channels, 1, TAPS, generator=g) * 0.5).to(dtype),
            "A_log": torch.log(torch.rand(HV, generator=g) * 16 + 0.5).to(dtype),
            "dt_bias": torch.randn(HV, generator=g).to(dtype),
            "norm_weight": (1 + 0.1 * torch.randn(DV, generator=g)).to(dtype),
            "head_k_dim": dk, "head_v_dim": DV, "eps": 1e-6}


def layer_inputs(dtype, batch=1, steps=STEPS, seed=1, dk=DK):
    g = gen(seed)
    shapes = {"mixed_qkv": 2 * HK * dk + HV * DV, "z": HV * DV, "a": HV, "b": HV}
    return {name: torch.randn(batch, steps, width, generator=g).to(dtype) for name, width in shapes.items()}


def run_in_pieces(inputs, weights, pieces, state=None):
    """The layer over consecutive pieces of the sequence, each call carrying the previous one's state."""
    outputs, start = [], 0
    for size in pieces:
        piece = {name: x[:, start:start + size] for name, x in inputs.items()}
        y, state = gated_delta.gated_delta_net(**piece, **weights, state=state)
        outputs.append(y)
        start += size
    return torch.cat(outputs, 1), state


def assert_same(first, second):
    (y1, s1), (y2, s2) = first, second
    assert torch.equal(y1, y2)
    assert torch.equal(s1.conv, s2.conv) and torch.equal(s1.recurrent, s2.recurrent)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    return request.param


@torch.no_grad()
@pytest.mark.parametrize("split", SPLITS)
def test_any_split_gives_the_full_sequences_bits(dtype, split):
    assert sum(SPLITS[split]) == STEPS
    inputs, weights = layer_inputs(dtype), layer_weights(dtype)
    assert_same(run_in_pieces(inputs, weights, [STEPS]), run_in_pieces(inputs, weights, SPLITS[split]))


@torch.no_grad()
def test_any_split_gives_the_full_sequences_bits_in_the_torch_code(dtype):
    inputs, weights = layer_inputs(dtype, steps=40), layer_weights(dtype)
    with ops.switched(native=False):
        full = run_in_pieces(inputs, weights, [40])
        for pieces in ([1] * 40, [7] * 5 + [5], [13, 27]):
            assert_same(full, run_in_pieces(inputs, weights, pieces))


def batch_of_three(dtype, steps=(STEPS, 61, 97)):
    """Three sequences of other lengths, right-padded into one batch (row 1 is the one of interest)."""
    rows = [layer_inputs(dtype, steps=n, seed=10 + i) for i, n in enumerate(steps)]
    width = max(steps)
    batch = {name: torch.cat([F.pad(r[name], (0, 0, 0, width - r[name].shape[1]), value=7.0) for r in rows])
             for name in rows[0]}
    return rows, batch, torch.tensor(steps)


@torch.no_grad()
@pytest.mark.parametrize("native_core", [True, False], ids=["cpp", "torch"])
def test_a_sequence_has_the_same_bits_alone_and_in_a_batch(dtype, native_core):
    weights = layer_weights(dtype)
    rows, batch, lengths = batch_of_three(dtype, steps=(61, STEPS, 97))
    with contextlib.nullcontext() if native_core else ops.switched(native=False):
        y, state = gated_delta.gated_delta_net(**batch, **weights, lengths=lengths)
        for row, n in enumerate(lengths.tolist()):
            alone_y, alone_state = gated_delta.gated_delta_net(**rows[row], **weights)
            assert torch.equal(y[row:row + 1, :n], alone_y)
            assert torch.equal(state.conv[row:row + 1], alone_state.conv)
            assert torch.equal(state.recurrent[row:row + 1], alone_state.recurrent)


@torch.no_grad()
@pytest.mark.parametrize("native_core", [True, False], ids=["cpp", "torch"])
def test_one_and_two_threads_give_the_same_bits(native_core):
    weights = layer_weights(torch.float32)
    _, batch, lengths = batch_of_three(torch.float32)
    with contextlib.nullcontext() if native_core else ops.switched(native=False):
        results = []
        for n in (1, 2):
            with threads(n):
                results.append(gated_delta.gated_delta_net(**batch, **weights, lengths=lengths))
    assert_same(*results)


def core_inputs(batch, steps, heads, dk, dv, seed):
    g = gen(seed)
    q = F.normalize(torch.randn(batch, steps, heads, dk, generator=g), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(batch, steps, heads, dk, generator=g), dim=-1)
    v = torch.randn(batch, steps, heads, dv, generator=g)
    decay = torch.exp(-torch.rand(batch, steps, heads, generator=g) * 3)
    beta = torch.rand(batch, steps, heads, generator=g)
    state = torch.randn(batch, heads, dv, dk, generator=g)
    return q, k, v, decay, beta, state


@torch.no_grad()
@pytest.mark.parametrize("dk, dv", [(16, 8), (12, 5), (64, 3), (128, 128)])  # AVX-512 path: dk 16, 64, 128
def test_the_cpp_core_computes_the_torch_codes_bits(dk, dv):
    assert native.lib() is not None, "the native library did not build (see the RuntimeWarning)"
    steps = 9 if dk == 128 else 40
    args = core_inputs(3, steps, 2, dk, dv, seed=dk)
    lengths = torch.tensor([steps, 0, steps // 3])
    assert ops._route("delta_rule", torch.device("cpu"), *args).run is native.lib().delta_rule
    with ops.switched(native=False):
        assert ops._route("delta_rule", torch.device("cpu"), *args) is ops.SPECIFICATION
        reference = gated_delta.delta_rule(*args, lengths)
    for n in (1, 2):
        with threads(n):
            fast = gated_delta.delta_rule(*args, lengths)
        assert torch.equal(fast[0], reference[0]) and torch.equal(fast[1], reference[1])
    assert torch.equal(reference[1][1], args[-1][1]) and not reference[0][1].any()  # length 0: untouched


@torch.no_grad()
def test_the_layer_in_cpp_and_in_torch_gives_the_same_bits(dtype):
    inputs, weights = layer_inputs(dtype, batch=2, steps=50, dk=12), layer_weights(dtype, dk=12)
    fast = run_in_pieces(inputs, weights, [31, 19])
    with ops.switched(native=False):
        assert_same(fast, run_in_pieces(inputs, weights, [31, 19]))


def slot_step(dtype, dk, dv, weight_dtype, seed=5):
    """A serving step over state slots: four sequences (a fresh 9-token prefill, a continuing 6-token chunk, a
    1-token decode, an empty one) in slots 4, 0, 2, 1 of 5, conv states in vLLM's (slots, K - 1, C) layout seen
    transposed, random entering states; the op's keyword arguments."""
    g = gen(seed)
    channels, lengths = 2 * HK * dk + HV * dv, [9, 6, 1, 0]
    total = sum(lengths)
    mixed_qkvz = torch.randn(total, channels + HV * dv, generator=g).to(dtype)
    ba = torch.randn(total, 2 * HV, generator=g).to(dtype)
    weights = layer_weights(dtype, seed=seed, dk=dk)
    weights["conv_weight"] = (torch.randn(channels, 1, TAPS, generator=g) * 0.5).to(dtype)
    weights["norm_weight"] = (1 + 0.1 * torch.randn(dv, generator=g)).to(weight_dtype)
    return dict(
        mixed_qkv=mixed_qkvz[:, :channels], z=mixed_qkvz[:, channels:], b=ba[:, :HV], a=ba[:, HV:],
        cu_seqlens=torch.tensor([0, *lengths]).cumsum(0).to(torch.int32), slots=torch.tensor([4, 0, 2, 1]),
        fresh=torch.tensor([True, False, False, False]),
        conv_cache=torch.randn(5, TAPS - 1, channels, generator=g).to(dtype).transpose(1, 2),
        state_cache=torch.randn(5, HV, dv, dk, generator=g), **{**weights, "head_v_dim": dv})


def run_slot_step(args):
    """The op on fresh copies of the caches: ``(y, conv_cache, state_cache)`` after it."""
    args = {**args, "conv_cache": args["conv_cache"].clone(), "state_cache": args["state_cache"].clone()}
    return gated_delta.gated_delta_net_slots(**args), args["conv_cache"], args["state_cache"]


@torch.no_grad()
@pytest.mark.parametrize("dk, dv, weight_dtype", [(16, 8, None), (12, 5, None), (128, 128, None),
                                                  (16, 8, torch.float32)], ids=["vector", "scalar", "qwen35",
                                                                                "fp32-norm-weight"])
def test_the_slot_step_in_cpp_computes_the_torch_codes_bits(dtype, dk, dv, weight_dtype):
    """The serving engine's whole GDN layer step as one C++ call == the torch code (gated_delta_net_varlen on
    the gathered slots), output and both caches, at 1 and 2 threads; untouched slots stay as they were. The
    twin: the same step with one sequence's state dropped (fresh) changes that sequence's rows, so the
    comparison sees the state."""
    args = slot_step(dtype, dk, dv, weight_dtype or dtype)
    assert ops._route("gated_delta_net_slots", torch.device("cpu"), args["mixed_qkv"], args["z"], args["a"],
                      args["b"], args["conv_cache"], args["state_cache"], args["conv_weight"].squeeze(1),
                      args["norm_weight"]).path == "native"
    with ops.switched(native=False):
        reference = run_slot_step(args)
    for n in (1, 2):
        with threads(n):
            fast = run_slot_step(args)
        assert all(torch.equal(x, y) for x, y in zip(fast, reference))
    assert torch.equal(fast[2][3], args["state_cache"][3]) and torch.equal(fast[1][3], args["conv_cache"][3])
    dropped = run_slot_step({**args, "fresh": torch.tensor([True, True, False, False])})
    assert not torch.equal(dropped[0][9:15], fast[0][9:15]) and torch.equal(dropped[0][15:], fast[0][15:])


def test_the_trainers_forward_under_autograd_gives_the_rollouts_bits(dtype):
    """With a gradient the layer runs the torch code (autograd's graph), without one the C++ core."""
    inputs, weights = layer_inputs(dtype, batch=2, steps=33), layer_weights(dtype)
    with torch.no_grad():
        rollout = run_in_pieces(inputs, weights, [20, 1, 12])
    leaves = {name: x.clone().requires_grad_() for name, x in inputs.items()}
    trainer = gated_delta.gated_delta_net(**leaves, **weights)
    assert trainer[0].requires_grad
    assert_same(rollout, (trainer[0].detach(), gated_delta.GatedDeltaState(*(s.detach() for s in trainer[1]))))


def packed(pieces):
    """The rows of ``pieces`` (each ``{name: (1, T_i, ...)}``) laid end to end, and their cu_seqlens."""
    flat = {name: torch.cat([p[name][0] for p in pieces]) for name in pieces[0]}
    bounds = torch.tensor([0] + [p["a"].shape[1] for p in pieces]).cumsum(0)
    return flat, bounds


def test_packed_sequences_have_each_sequences_bits_alone(dtype):
    """gated_delta_net_varlen: sequences laid end to end (training's packed row, vLLM's batch), each with its
    own entering state (fresh or carried), == each sequence alone; the twin: the same tokens as one sequence
    (no split at the boundaries) let the state leak and differ."""
    weights = layer_weights(dtype)
    pieces = [layer_inputs(dtype, steps=n, seed=10 + n) for n in (23, 5, 30)]
    _, carried = gated_delta.gated_delta_net(**layer_inputs(dtype, steps=9, seed=3), **weights)
    entering = [None, carried, None]
    alone = [gated_delta.gated_delta_net(**p, **weights, state=s) for p, s in zip(pieces, entering)]
    fresh = gated_delta.gated_delta_net(**layer_inputs(dtype, steps=0), **weights)[1]
    states = [fresh if s is None else s for s in entering]
    batched = gated_delta.GatedDeltaState(*(torch.cat(parts) for parts in zip(*states)))
    flat, bounds = packed(pieces)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            inputs = {name: x.clone().requires_grad_(grad) for name, x in flat.items()}
            y, state = gated_delta.gated_delta_net_varlen(**inputs, **weights, cu_seqlens=bounds, state=batched)
        assert torch.equal(y.detach(), torch.cat([out[0][0] for out in alone]))
        for i, (_, s) in enumerate(alone):
            assert torch.equal(state.conv[i], s.conv[0]) and torch.equal(state.recurrent[i], s.recurrent[0])
    leaked, _ = gated_delta.gated_delta_net_varlen(**flat, **weights, cu_seqlens=bounds[[0, -1]])
    assert not torch.equal(leaked[23:], y.detach()[23:])


# ----------------------------------------------------------------------------------------------
# Against transformers' references (close, not bitwise)
# ----------------------------------------------------------------------------------------------

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def hf_core_inputs(steps=70, seed=3):
    g = gen(seed)
    q, k = torch.randn(2, steps, HV, DK, generator=g), torch.randn(2, steps, HV, DK, generator=g)
    v = torch.randn(2, steps, HV, DV, generator=g)
    gate = -torch.rand(2, steps, HV, generator=g) * 2
    beta = torch.rand(2, steps, HV, generator=g)
    return [x.requires_grad_() for x in (q, k, v, gate, beta)]


def test_gradient_is_close_to_transformers_chunked_reference():
    ours_inputs, hf_inputs = hf_core_inputs(), hf_core_inputs()
    ours, ours_state = gated_delta.gated_delta_rule(*ours_inputs)
    reference, reference_state = hf.torch_chunk_gated_delta_rule(*hf_inputs, output_final_state=True,
                                                                  use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours_state, reference_state.transpose(-1, -2), rtol=1e-4, atol=1e-5)
    weights = torch.randn(ours.shape, generator=gen(5))
    (ours * weights).sum().backward()
    (reference * weights).sum().backward()
    for name, mine, theirs in zip("q k v g beta".split(), ours_inputs, hf_inputs):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def hf_layer():
    config = hf.Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=HK, linear_num_value_heads=HV,
                                  linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=TAPS)
    torch.manual_seed(0)
    module = hf.Qwen3_5GatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        module.norm.weight.copy_(1 + 0.1 * torch.randn(DV))
        module.dt_bias.copy_(torch.randn(HV))
    return module


@torch.no_grad()
def test_the_layer_is_close_to_transformers_module():
    module = hf_layer()
    hidden = torch.randn(2, 45, 32, generator=gen(7))
    y, _ = gated_delta.gated_delta_net(
        module.in_proj_qkv(hidden), module.in_proj_z(hidden), module.in_proj_a(hidden), module.in_proj_b(hidden),
        conv_weight=module.conv1d.weight, A_log=module.A_log, dt_bias=module.dt_bias, norm_weight=module.norm.weight,
        head_k_dim=DK, head_v_dim=DV, eps=module.layer_norm_epsilon)
    torch.testing.assert_close(module.out_proj(y), module(hidden), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Twins: the stock torch paths and kernels, without the fix
# ----------------------------------------------------------------------------------------------


def hf_split_differs(seed: int, dtype) -> tuple[bool, bool]:
    """(chunked full != recurrent token by token, chunked full != chunked prefix + continuation), bitwise."""
    q, k, v, g, beta = (x.detach().to(dtype) for x in hf_core_inputs(steps=90, seed=seed))
    g = g.float()
    kwargs = {"use_qk_l2norm_in_kernel": True, "output_final_state": True}
    full, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    state, steps = None, []
    for t in range(q.shape[1]):
        out, state = hf.torch_recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                                         beta[:, t:t + 1], initial_state=state, **kwargs)
        steps.append(out)
    prefix, state = hf.torch_chunk_gated_delta_rule(q[:, :50], k[:, :50], v[:, :50], g[:, :50], beta[:, :50], **kwargs)
    rest, _ = hf.torch_chunk_gated_delta_rule(q[:, 50:], k[:, 50:], v[:, 50:], g[:, 50:], beta[:, 50:],
                                              initial_state=state, **kwargs)
    return not torch.equal(full, torch.cat(steps, 1)), not torch.equal(full, torch.cat([prefix, rest], 1))


@torch.no_grad()
@pytest.mark.parametrize("twin", ["token by token", "prefix + continuation"])
def test_twin_transformers_torch_paths_depend_on_the_split(dtype, twin):
    index = 0 if twin == "token by token" else 1
    assert any(hf_split_differs(seed, dtype)[index] for seed in range(8)), \
        f"no inputs found where transformers' chunked full sequence and its {twin} differ"


@pytest.mark.parametrize("kernel, ours", [(torch.sigmoid, ops.sigmoid), (F.softplus, gated_delta.softplus)],
                         ids=["sigmoid", "softplus"])
def test_twin_torchs_kernels_depend_on_the_position(kernel, ours):
    x = torch.randn(4096, generator=gen(11)) * 8
    found = False
    for start, size in ((0, 1), (3, 5), (7, 17), (11, 33), (1, 4000)):
        part = x[start:start + size].clone()
        assert torch.equal(ours(part), ours(x)[start:start + size])
        found = found or not torch.equal(kernel(part), kernel(x)[start:start + size])
    assert found, f"{kernel.__name__} gave the same bits at every position tried"


def test_bad_inputs_are_refused_by_name():
    q, k, v, decay, beta, state = core_inputs(1, 3, 2, 16, 8, seed=0)
    with pytest.raises(ValueError, match="state is torch.bfloat16"):
        gated_delta.delta_rule(q, k, v, decay, beta, state.bfloat16())
    with pytest.raises(ValueError, match="lengths"):
        gated_delta.delta_rule(q, k, v, decay, beta, state, torch.tensor([4]))
    inputs, weights = layer_inputs(torch.float32, steps=3), layer_weights(torch.float32)
    with pytest.raises(ValueError, match="mixed_qkv width"):
        gated_delta.gated_delta_net(**inputs, **{**weights, "head_k_dim": 5})
    _, state = gated_delta.gated_delta_net(**inputs, **weights)
    with pytest.raises(ValueError, match="conv_state is torch.bfloat16"):
        gated_delta.gated_delta_net(**inputs, **weights, state=state._replace(conv=state.conv.bfloat16()))
