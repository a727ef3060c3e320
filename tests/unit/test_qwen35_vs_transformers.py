"""Qwen3.5 (dense and MoE) on the consistent path held to stock transformers, not to itself.

Stock: the same weights through transformers' own module code (flag off: every patched forward calls
transformers' original, the linears are ``F.linear``), eager attention, one sequence per call (its Gated
DeltaNet carries the state across a packed row: ``test_qwen35_model.py``, the packed-row test's twin).
Ours: the flag on, the sequences packed in one row as verl's trainer lays them out (each has its bits alone).
Closeness, never bitwise (another summation order, the recurrent Gated DeltaNet against transformers' chunked
one): fp32 log-probs within a stated tolerance; bf16 log-probs as close to stock fp32 as stock bf16 is;
gradients per parameter against transformers in float64; the shared expert and the gated attention against
transformers' modules. Each bound has a twin that exceeds it.
"""

from __future__ import annotations

import copy
import functools
import inspect

import pytest
import torch

from kernel_helpers import patched_transformers  # noqa: F401 (an autouse fixture)
from test_qwen35_model import KINDS, tokens, train
from true_on_policy.kernels import moe, ops
from true_on_policy.tiny_assets import build_model
from true_on_policy.transformers_adapter.training_attention import ATTN_IMPLEMENTATION

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
hf_moe = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")

LENGTHS = (70, 9, 40)  # 70 crosses transformers' 64-token Gated DeltaNet chunk
DECAY_PATH = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.in_proj_a.weight")

# Tolerances measured on an AMD EPYC (AVX2, no avx512_bf16 / amx_bf16; torch 2.13.0+cpu, transformers 5.9.0),
# 2026-12-06, these inputs; each bound sits above its measurement with a margin (held with 5.10.4 on 2026-12-07).
LOGPROB_ATOL_FP32 = 4e-6  # measured max |ours - stock| 9.5e-7 (dense), 4.8e-7 (MoE); log-probs ~ -5
BF16_FACTOR = 1.5  # mean |ours bf16 - stock fp32| / mean |stock bf16 - stock fp32|, measured 1.03 (dense), 1.19 (MoE)
BF16_MAX_FACTOR = 3.0  # the same at the worst token, measured 1.00 (dense), 1.90 (MoE: a router flip)
# MODULE_RTOL: of the module's largest output entry; measured 3.3e-7 (shared expert), 3.5e-7 (MoE block),
# 2.5e-7 (gated attention)
MODULE_RTOL = 1e-5
GRAD_RTOL = 1e-5  # measured worst per parameter vs float64: 2.8e-6 (dense), 8.2e-7 (MoE)


@pytest.fixture(autouse=True)
def flag_off_after():
    yield
    ops.set_switches(consistent=False)


def ours_model(kind: str, dtype: torch.dtype):
    model = build_model(kind, seed=0).to(dtype)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def stock_model(kind: str, dtype: torch.dtype):
    model = build_model(kind, seed=0).to(dtype)
    model.set_attn_implementation("eager")
    return model


def sequences() -> list[torch.Tensor]:
    return [tokens(n, 40 + n) for n in LENGTHS]


def ours_log_probs(model, seqs) -> torch.Tensor:
    with ops.consistent(True):
        rows = torch.split(train(model, seqs), [len(s) for s in seqs])
    return torch.cat([ops.token_log_probs(r[:-1].float(), s[1:]) for r, s in zip(rows, seqs)])


def stock_log_probs(model, seqs, packed: bool = False) -> torch.Tensor:
    with ops.consistent(False), torch.no_grad():
        if packed:  # the twin: transformers' own forward over verl's packed row
            rows = torch.split(train(model, seqs), [len(s) for s in seqs])
        else:
            rows = [model(input_ids=s[None]).logits[0] for s in seqs]
    return torch.cat([torch.log_softmax(r[:-1].float(), -1).gather(-1, s[1:, None])[:, 0] for r, s in zip(rows, seqs)])


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over the largest |b|."""
    return max_diff(a, b) / float(b.abs().max())


@functools.cache
def stock_reference(kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Stock transformers' log-probs of :func:`sequences`, one sequence per call."""
    return stock_log_probs(stock_model(kind, dtype), sequences())


# ----------------------------------------------------------------------------------------------
# Log-probs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_log_probs_are_close_to_stock_transformers(kind):
    assert max_diff(ours_log_probs(ours_model(kind, torch.float32), sequences()),
                    stock_reference(kind, torch.float32)) <= LOGPROB_ATOL_FP32


@pytest.mark.parametrize("kind", KINDS)
def test_twin_a_leaked_state_or_a_gated_norm_off_by_1e_3_exceeds_the_fp32_tolerance(kind):
    """What the tolerance sees: transformers over the packed row (the state leaks into the next sequence),
    and our forward on a model whose first Gated DeltaNet layer has its gated norm's weight 0.1 % off."""
    seqs = sequences()
    stock = stock_reference(kind, torch.float32)
    assert max_diff(stock_log_probs(stock_model(kind, torch.float32), seqs, packed=True), stock) > LOGPROB_ATOL_FP32
    model = ours_model(kind, torch.float32)
    with torch.no_grad():
        model.model.layers[0].linear_attn.norm.weight.mul_(1 + 1e-3)
    assert max_diff(ours_log_probs(model, seqs), stock) > LOGPROB_ATOL_FP32


def bf16_distances(kind: str, ours) -> dict[str, tuple[float, float]]:
    """|ours bf16 - stock fp32| and |stock bf16 - stock fp32| over every token: their means and maxima."""
    reference = stock_reference(kind, torch.float32)
    mine = (ours_log_probs(ours, sequences()) - reference).abs()
    stock = (stock_reference(kind, torch.bfloat16) - reference).abs()
    return {"mean": (float(mine.mean()), float(stock.mean())), "max": (float(mine.max()), float(stock.max()))}


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_log_probs_are_as_close_to_fp32_as_stock_bf16(kind):
    """bf16 has no fixed tolerance: ours in bf16 is as far from stock fp32 as stock bf16 is (the same weights,
    cast) -- on average within BF16_FACTOR, at the worst token within BF16_MAX_FACTOR. The worst token is
    looser because in bf16 a router near a tie picks other experts than in fp32, at other tokens in each
    model: measured 2026-12-06 (MoE), ours flips 2 tokens' top-2 in layer 1 (the worst, 0.023), stock bf16 2
    others in layers 2 and 3 (its worst, 0.012)."""
    distances = bf16_distances(kind, ours_model(kind, torch.bfloat16))
    (mean, stock_mean), (worst, stock_worst) = distances["mean"], distances["max"]
    assert 0 < stock_mean and mean <= BF16_FACTOR * stock_mean, distances
    assert worst <= BF16_MAX_FACTOR * stock_worst, distances


@pytest.mark.parametrize("kind", KINDS)
def test_twin_a_bf16_model_two_ulps_off_in_its_norms_exceeds_the_bf16_bound(kind):
    """What the bound sees: every decoder RMSNorm weight of our bf16 model moved by two bf16 ulps of (1 + w)."""
    model = ours_model(kind, torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.add_(2.0 ** -6)
    distances = bf16_distances(kind, model)
    assert distances["mean"][0] > BF16_FACTOR * distances["mean"][1], distances


# ----------------------------------------------------------------------------------------------
# Gradients, per parameter
# ----------------------------------------------------------------------------------------------


def float64_chunk_rule(module):
    """transformers' own ``torch_chunk_gated_delta_rule`` with its float32 casts made float64 (the only edit)."""
    source = inspect.getsource(module.torch_chunk_gated_delta_rule)
    assert source.count("torch.float32") == 1, "transformers' chunked rule changed: re-check the float64 edit"
    namespace: dict = {}
    exec(source.replace("torch.float32", "torch.float64"), module.__dict__, namespace)  # noqa: S102
    return namespace["torch_chunk_gated_delta_rule"]


def float64_model(kind: str):
    """The stock model in float64, its Gated DeltaNet's chunked rule and its experts too (eager experts:
    transformers' grouped_mm takes no float64)."""
    model = stock_model(kind, torch.float64)
    model.config._experts_implementation = "eager"
    rule = float64_chunk_rule(hf if kind == "qwen35" else hf_moe)
    for module in model.modules():
        if hasattr(module, "chunk_gated_delta_rule"):
            module.chunk_gated_delta_rule = rule
    return model


def gradients(model, seqs, flag: bool) -> dict[str, torch.Tensor]:
    """The gradient of the sequences' summed log-likelihood: ours packed (flag on), stock one sequence per call."""
    model.zero_grad()
    with ops.consistent(flag):
        if flag:
            rows = torch.split(train(model, seqs, grad=True), [len(s) for s in seqs])
            total = sum(ops.token_log_probs(r[:-1].float(), s[1:]).sum() for r, s in zip(rows, seqs))
        else:
            total = sum(torch.log_softmax(model(input_ids=s[None]).logits[0][:-1], -1).gather(-1, s[1:, None]).sum()
                        for s in seqs)
        total.backward()
    return {name: p.grad.double() for name, p in model.named_parameters() if p.grad is not None}


def relative_errors(grads, reference) -> dict[str, float]:
    """Per parameter: max |grad - reference| / max |reference| (its own largest entry)."""
    assert grads.keys() == reference.keys()
    return {name: max_diff(grads[name], ref) / float(ref.abs().max()) for name, ref in reference.items()}


@pytest.fixture(scope="module")
def measured_gradients():
    seqs = [tokens(n, 20 + n) for n in (21, 13)]
    return {kind: {"ours": gradients(ours_model(kind, torch.float32), seqs, True),
                   "stock": gradients(stock_model(kind, torch.float32), seqs, False),
                   "float64": gradients(float64_model(kind), seqs, False)} for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_per_parameter_are_close_to_transformers_in_float64(measured_gradients, kind):
    """Every parameter's gradient (fp32, flag on) within GRAD_RTOL of its own largest entry of transformers'
    gradient in float64. Why float64 and not stock fp32: on the Gated DeltaNet's decay path (A_log, dt_bias,
    in_proj_a) stock fp32 is the inaccurate one. Measured 2026-12-06, per parameter against float64: the dense
    model's layer 0 has decay gradients ~1e-6 (its other parameters' 4e-2 to 1.5, the model's largest 4.4; per
    token the ``<dS, S>`` products that make them cancel up to 4e3-fold); there stock fp32 is 19 % (A_log),
    17 % (dt_bias), 3.8 % (in_proj_a) off, ours 2.6e-6, 2.8e-6, 1.2e-6; MoE layer 2: stock 7.6e-4, ours under
    1e-6. So the gap between ours and stock fp32 there (the 18 % the previous whole-model check hid) is the
    error of transformers' chunked form in fp32, not ours. Off that path ours and stock fp32 agree within
    GRAD_RTOL (asserted)."""
    grads = measured_gradients[kind]
    against_float64 = relative_errors(grads["ours"], grads["float64"])
    assert max(against_float64.values()) <= GRAD_RTOL, max(against_float64.items(), key=lambda item: item[1])
    against_stock = relative_errors(grads["ours"], grads["stock"])
    off_path = {name: err for name, err in against_stock.items() if not name.endswith(DECAY_PATH)}
    assert max(off_path.values()) <= GRAD_RTOL, max(off_path.items(), key=lambda item: item[1])


@pytest.mark.parametrize("kind", KINDS)
def test_twin_stock_fp32_decay_gradients_fail_the_per_parameter_bound(measured_gradients, kind):
    """The bound can fail: stock fp32 against float64 exceeds GRAD_RTOL on the decay path, where the
    previous check (relative to the model's largest gradient entry, 1e-6) saw nothing."""
    grads = measured_gradients[kind]
    stock = relative_errors(grads["stock"], grads["float64"])
    failing = sorted(name for name, err in stock.items() if err > GRAD_RTOL)
    assert failing and all(name.endswith(DECAY_PATH) for name in failing), failing
    largest = max(float(g.abs().max()) for g in grads["float64"].values())
    assert max(max_diff(grads["stock"][n], g) for n, g in grads["float64"].items()) <= 1e-6 * largest


# ----------------------------------------------------------------------------------------------
# Modules: the shared expert and the gated attention against transformers' own
# ----------------------------------------------------------------------------------------------


def stock_shared_expert_block():
    """transformers' Qwen3.5-MoE block of layer 0 with its routed experts zeroed: its output is transformers'
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``, computed by its own modules."""
    block = copy.deepcopy(stock_model("qwen35_moe", torch.float32).model.layers[0].mlp)
    assert isinstance(block, hf_moe.Qwen3_5MoeSparseMoeBlock)
    with torch.no_grad():
        for p in block.experts.parameters():
            p.zero_()
    return block


@torch.no_grad()
def test_shared_expert_is_transformers_shared_expert_module():
    block, x = stock_shared_expert_block(), torch.randn(13, 64, generator=torch.Generator().manual_seed(6))
    with ops.consistent(False):
        theirs = block(x[None])[0]
    shared = block.shared_expert
    weights = (shared.gate_proj.weight, shared.up_proj.weight), shared.down_proj.weight, block.shared_expert_gate.weight
    assert relative_diff(moe.shared_expert(x, *weights), theirs) <= MODULE_RTOL
    swapped = (shared.up_proj.weight, shared.gate_proj.weight), *weights[1:]  # twin: vLLM's merged order misread
    assert relative_diff(moe.shared_expert(x, *swapped), theirs) > 0.1


@torch.no_grad()
def test_moe_block_is_transformers_sparse_moe_block():
    """The whole block (router, experts, shared expert), flag on, against transformers' block, flag off."""
    x = torch.randn(1, 13, 64, generator=torch.Generator().manual_seed(7))
    ours_block = ours_model("qwen35_moe", torch.float32).model.layers[0].mlp
    with ops.consistent(True):
        ours = ours_block(x)
    with ops.consistent(False):
        theirs = stock_model("qwen35_moe", torch.float32).model.layers[0].mlp(x)
    assert relative_diff(ours, theirs) <= MODULE_RTOL


def attention_outputs(monkeypatch=None, drop_gate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, transformers') Qwen3_5Attention of the dense model's full-attention layer on one sequence."""
    x = torch.randn(1, 21, 64, generator=torch.Generator().manual_seed(8))
    positions = torch.arange(21)[None]
    ours, stock = ours_model("qwen35", torch.float32), stock_model("qwen35", torch.float32)
    assert isinstance(stock.model.layers[3].self_attn, hf.Qwen3_5Attention)
    if drop_gate:
        monkeypatch.setattr(ops, "sigmoid_gate", lambda out, gate: out)
    with torch.no_grad(), ops.consistent(True):
        mine = ours.model.layers[3].self_attn(x, ours.model.rotary_emb(x, positions), None, position_ids=positions)[0]
    causal = torch.full((21, 21), float("-inf")).triu(1)[None, None]
    with torch.no_grad(), ops.consistent(False):
        theirs = stock.model.layers[3].self_attn(x, stock.model.rotary_emb(x, positions), causal)[0]
    return mine, theirs


def test_gated_attention_is_transformers_gated_attention_module():
    assert relative_diff(*attention_outputs()) <= MODULE_RTOL


def test_twin_attention_without_its_output_gate_is_not_transformers(monkeypatch):
    ours, theirs = attention_outputs(monkeypatch, drop_gate=True)
    assert relative_diff(ours, theirs) > 0.1
