"""The consistent Gated DeltaNet's training path (``gated_delta.CheckpointedDeltaRule``).

Bitwise (``torch.equal``): with a gradient, the core's output and final state, and the layer's output in
fp32 and from bf16 inputs, are the bits of the path it replaces (autograd through ``delta_rule_torch``).
Close: its gradients (the torch walk and the C++ walk) against autograd's through ``delta_rule_torch``,
within GRAD_TOLERANCE of each tensor's own largest entry, on shapes with right-padded rows and lengths
that are not a multiple of the chunk. Memory: what the forward saves for backward is the inputs plus one
state per chunk; the path it replaces saves states per token (the twin).
"""

from __future__ import annotations

import math

import pytest
import torch

from true_on_policy.kernels import gated_delta, ops

# (B, T, H, dk, dv, lengths): a padded row, a row of 0 tokens, T not a multiple of CHUNK, dk a power of two
# (the C++ vector path) and not
SHAPES = [(2, 150, 3, 16, 8, [150, 77]), (3, 130, 2, 12, 8, [0, 64, 129]), (1, 64, 2, 32, 16, None),
          (1, 200, 1, 16, 16, None)]
# Measured (2026-12-06, fp32, these shapes, chunks of 64 and 7, the torch and the C++ walk): max |ours - autograd|
# per tensor <= 3e-7 of that tensor's largest entry. The tolerance leaves 30x for other CPUs and longer rows.
GRAD_TOLERANCE = 1e-5


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def core_inputs(batch, steps, heads, dk, dv, seed=0):
    """Inputs as gated_delta_rule hands them to the core: q, k l2-normed (q scaled), decay in (0.6, 1)."""
    g = gen(seed)
    q = torch.nn.functional.normalize(torch.randn(batch, steps, heads, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(batch, steps, heads, dk, generator=g), dim=-1)
    v = torch.randn(batch, steps, heads, dv, generator=g)
    decay = torch.exp(-torch.rand(batch, steps, heads, generator=g) * 0.5)
    beta = torch.sigmoid(torch.randn(batch, steps, heads, generator=g))
    state = torch.randn(batch, heads, dv, dk, generator=g) * 0.1
    return [x.requires_grad_() for x in (q, k, v, decay, beta, state)]


def walks():
    """The backward walks this process has: the torch one always, the C++ one where the library has it."""
    yield "torch"
    with ops.switched(native=True):
        if ops._route("delta_rule_backward", torch.device("cpu"), torch.zeros(1)).run is not None:
            yield "cpp"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])))
@pytest.mark.parametrize("chunk", [64, 7])
def test_forward_bits_and_gradients_match_autograd_through_the_specification(shape, chunk, monkeypatch):
    monkeypatch.setattr(gated_delta, "CHUNK", chunk)
    *dims, lengths = shape
    lengths = None if lengths is None else torch.tensor(lengths)
    inputs = core_inputs(*dims)
    g = gen(9)
    grad_out, grad_state = torch.randn(inputs[2].shape, generator=g), torch.randn(inputs[5].shape, generator=g)
    out, state = gated_delta.delta_rule_torch(*inputs, lengths)
    reference = torch.autograd.grad((out * grad_out).sum() + (state * grad_state).sum(), inputs)
    for walk in walks():
        with ops.switched(native=walk == "cpp"):
            ours_out, ours_state = gated_delta.delta_rule(*inputs, lengths)
            assert torch.equal(ours_out, out) and torch.equal(ours_state, state), walk
            ours = torch.autograd.grad((ours_out * grad_out).sum() + (ours_state * grad_state).sum(), inputs)
        for name, mine, theirs in zip(["q", "k", "v", "decay", "beta", "state"], ours, reference):
            error = float((mine - theirs).abs().max())
            assert error <= GRAD_TOLERANCE * float(theirs.abs().max()), f"{walk} d{name}: {error}"
        if lengths is not None:  # past a row's length: no gradient to its inputs
            for grad in ours[:5]:
                assert not bool(grad[1, int(lengths[1]):].any())


def test_the_native_switch_off_forces_the_torch_walk():
    with ops.switched(native=False):
        assert ops._route("delta_rule_backward", torch.device("cpu"), torch.zeros(1)).run is None


def test_no_token_passes_the_state_and_its_gradient_through():
    inputs = core_inputs(2, 0, 2, 4, 4)
    out, state = gated_delta.delta_rule(*inputs)
    assert out.shape == (2, 0, 2, 4) and torch.equal(state, inputs[5]) and state is not inputs[5]
    grad_state = torch.randn(state.shape, generator=gen(2))
    assert torch.equal(torch.autograd.grad(state, inputs[5], grad_state)[0], grad_state)


def test_a_gradient_runs_the_checkpointed_function(monkeypatch):
    calls = []
    monkeypatch.setattr(gated_delta.CheckpointedDeltaRule, "apply",
                        lambda *args: calls.append(args) or gated_delta.delta_rule_torch(*args))
    inputs = core_inputs(1, 5, 1, 4, 4)
    gated_delta.delta_rule(*inputs)
    with torch.no_grad():
        gated_delta.delta_rule(*inputs)
    assert len(calls) == 1


def layer(dtype, steps=75, seed=1):
    g = gen(seed)
    hk, hv, dk, dv = 2, 4, 16, 8
    weights = {"conv_weight": (torch.randn(2 * hk * dk + hv * dv, 1, 4, generator=g) * 0.5).to(dtype),
               "A_log": torch.log(torch.rand(hv, generator=g) * 16 + 0.5).to(dtype),
               "dt_bias": torch.randn(hv, generator=g).to(dtype),
               "norm_weight": (1 + 0.1 * torch.randn(dv, generator=g)).to(dtype),
               "head_k_dim": dk, "head_v_dim": dv, "eps": 1e-6}
    widths = {"mixed_qkv": 2 * hk * dk + hv * dv, "z": hv * dv, "a": hv, "b": hv}
    inputs = {name: torch.randn(2, steps, w, generator=g).to(dtype).requires_grad_() for name, w in widths.items()}
    return inputs, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_layer_under_autograd_has_the_replaced_paths_bits_and_close_gradients(dtype, monkeypatch):
    """gated_delta_net with a gradient (right-padded rows): output and state == the path this replaced
    (autograd through delta_rule_torch, planted as the twin), the inputs' gradients close to its."""
    inputs, weights = layer(dtype)
    lengths = torch.tensor([75, 40])
    weight = torch.randn(2, 75, 32, generator=gen(4))

    def run():
        y, state = gated_delta.gated_delta_net(**inputs, **weights, lengths=lengths)
        grads = torch.autograd.grad((y.float() * weight).sum(), list(inputs.values()))
        return y.detach(), state.recurrent.detach(), grads

    ours = run()
    with monkeypatch.context() as patch:
        patch.setattr(gated_delta, "delta_rule", gated_delta.delta_rule_torch)
        replaced = run()
    assert torch.equal(ours[0], replaced[0]) and torch.equal(ours[1], replaced[1])
    for mine, theirs in zip(ours[2], replaced[2]):
        if dtype == torch.float32:
            assert float((mine - theirs).abs().max()) <= GRAD_TOLERANCE * float(theirs.abs().max())
        else:  # bf16 gradients round to 8 bits: one unit in the last place of the largest entry
            assert float((mine.float() - theirs.float()).abs().max()) <= 2 ** -7 * float(theirs.float().abs().max())


def saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd saves for backward while ``fn`` runs."""
    seen = {}

    def pack(tensor):
        seen[(tensor.data_ptr(), tensor.shape, tensor.dtype)] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(seen.values())


def test_the_forward_saves_one_state_per_chunk_and_the_replaced_path_one_per_token():
    batch, steps, heads, dk, dv = 1, 300, 2, 16, 16
    inputs = core_inputs(batch, steps, heads, dk, dv)
    state_bytes = inputs[5].numel() * 4
    input_bytes = sum(x.numel() * 4 for x in inputs[:5]) + 8 * batch  # + lengths
    ours = saved_bytes(lambda: gated_delta.delta_rule(*inputs))
    assert ours == input_bytes + math.ceil(steps / gated_delta.CHUNK) * state_bytes
    replaced = saved_bytes(lambda: gated_delta.delta_rule_torch(*inputs))
    assert replaced >= steps * state_bytes  # the twin: at least one state per token
