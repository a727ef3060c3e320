"""The residual-logdiff diagnosis: known faults planted in the ROLLOUT copy of the same weights are
named with the right layer, op and category; identical models are clean with the flag on and show an
``operator`` divergence with the default kernels in bf16.

Categories follow the rules in true_on_policy/diagnose/compare.py: equal inputs and different parameters ->
weights; equal inputs and parameters but a different module configuration (attributes, attention
implementation, executed children...) -> implementation; nothing visible differs -> operator.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from true_on_policy.kernels import ops
from true_on_policy.diagnose import diagnose, inject_fault, make_router_ties
from true_on_policy.diagnose import capture, compare
from true_on_policy.tiny_assets import build_model
from kernel_helpers import patched_transformers  # noqa: F401 (patched_transformers: an autouse fixture)


_BASE: dict = {}


def pair(kind: str, dtype=torch.float32, ties_layer: int | None = None):
    """(training copy, rollout copy) of the same weights; optionally with router ties crafted in one layer."""
    if (kind, dtype) not in _BASE:
        _BASE[kind, dtype] = build_model(kind, seed=0).to(dtype)
    training = copy.deepcopy(_BASE[kind, dtype])
    if ties_layer is not None:
        make_router_ties(training, ties_layer)
    return training, copy.deepcopy(training)


def sequences():
    """Three requests: prompt lengths 4, 9, 3 and 6, 5, 4 teacher-forced decode tokens."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (10, 14, 7)]
    return seqs, [4, 9, 3]


def run(training, rollout, deterministic=True):
    seqs, prompts = sequences()
    return diagnose(training, rollout, seqs, prompt_lengths=prompts, deterministic=deterministic)


def row(report, op):
    return next(r for r in report.ops if r.op == op)


# ----------------------------------------------------------------------------------------------
# clean and flag-off baselines
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,dtype,ties",
    [("dense", torch.float32, None), ("moe", torch.bfloat16, 1)],
    ids=["dense-fp32", "moe-bf16-with-router-ties"],
)
def test_identical_models_with_the_flag_on_do_not_diverge(kind, dtype, ties):
    training, rollout = pair(kind, dtype, ties)
    report = run(training, rollout)
    assert report.first_divergence is None
    assert all(r.equal for r in report.ops), [r.op for r in report.ops if not r.equal]
    assert report.logprobs["max_abs"] == 0.0 and report.logprobs["equal"] == report.logprobs["tokens"] == 15
    ops_seen = {r.op for r in report.ops}
    expected = {
        "model.embed_tokens",
        "model.rotary_emb",
        "model.layers.1.input_layernorm",
        "model.layers.1.self_attn.q_norm",
        "model.layers.1.self_attn.rope",
        "model.layers.1.self_attn.attention",
        "model.layers.1.self_attn.o_proj",
        "model.norm",
        "lm_head",
        "log_softmax",
    }
    if kind == "moe":  # router logits, top-k, experts and their combine
        expected |= {"model.layers.1.mlp.gate", "model.layers.1.mlp.gate.topk", "model.layers.1.mlp.experts"}
        expected |= {"model.layers.1.mlp.experts.combine"}
    else:
        expected |= {"model.layers.1.mlp.gate_proj", "model.layers.1.mlp.down_proj"}
    assert expected <= ops_seen, expected - ops_seen
    assert all(r.tokens == 31 for r in report.ops)  # every real token of both sides compared


def test_identical_bf16_models_with_default_kernels_show_an_operator_divergence():
    training, rollout = pair("dense", torch.bfloat16)
    report = run(training, rollout, deterministic=False)
    d = report.first_divergence
    assert d is not None and d.category == "operator", d
    assert d.inputs_equal and d.details == []  # same inputs, params and config: the kernel itself
    assert report.logprobs["max_abs"] > 0
    # everything before the op is bitwise equal at the first differing position
    first = row(report, d.op)
    assert first.first_diff[1] == d.position
    for r in report.ops:
        if r.order < first.order and r.first_diff is not None and not capture._is_ancestor(r.op, d.op):
            assert r.first_diff[1] >= d.position


# ----------------------------------------------------------------------------------------------
# planted faults (rollout copy only)
# ----------------------------------------------------------------------------------------------


def test_rms_norm_eps_changed_in_one_layer_is_an_implementation_divergence_of_that_norm():
    training, rollout = pair("dense")
    inject_fault(rollout, "eps", layer=1)
    report = run(training, rollout)
    d = report.first_divergence
    assert (d.layer, d.op, d.category) == (1, "model.layers.1.post_attention_layernorm", "implementation")
    assert d.kind == "norm" and d.inputs_equal and (d.sequence, d.position) == (0, 0)
    assert any("variance_epsilon" in x and "0.01" in x for x in d.details)
    assert "rule 4" in d.fix
    assert row(report, "model.layers.1.self_attn.o_proj").equal  # upstream stays bitwise equal
    assert not row(report, "model.layers.1.mlp.down_proj").equal  # downstream follows


def test_one_perturbed_weight_is_a_weights_divergence_of_that_module_moe():
    training, rollout = pair("moe")
    inject_fault(rollout, "weight", layer=0)
    report = run(training, rollout)
    d = report.first_divergence
    assert (d.layer, d.op, d.category) == (0, "model.layers.0.self_attn.v_proj", "weights")
    assert any("v_proj.weight" in x and "1 element" in x for x in d.details)
    assert row(report, "model.layers.0.self_attn.k_proj").equal


def test_softmax_accumulated_in_bf16_in_one_layer_is_an_implementation_divergence_of_its_attention():
    """The fault is a variant attention function that layer 1 of the rollout copy is configured to use
    (its own config names another AttentionInterface entry). At that layer's attention kernel the
    inputs (rotated q, k and v) are bitwise equal and there are no parameters, but the configuration
    differs -- ``_attn_implementation`` and the function it resolves to -- so the rules say
    ``implementation`` (it would be ``operator`` only if no configuration/op difference were
    visible, e.g. the same attention name bound to another kernel inside the engine)."""
    training, rollout = pair("dense")
    inject_fault(rollout, "bf16-softmax", layer=1)
    report = run(training, rollout)
    d = report.first_divergence
    assert (d.layer, d.op, d.category) == (1, "model.layers.1.self_attn.attention", "implementation")
    assert d.kind == "attention" and d.inputs_equal
    assert any("_attn_implementation" in x and "bf16_softmax" in x for x in d.details)
    assert "rule 3" in d.fix and "rule 4" in d.fix
    assert row(report, "model.layers.1.self_attn.rope").equal  # the kernel's inputs are equal
    assert row(report, "model.layers.0.self_attn.attention").equal  # only the faulty layer


def test_additive_mask_instead_of_selection_is_named_at_the_attention_and_garbage_alone_is_harmless():
    """An additive -1e9 mask equals selection bit for bit on finite data (exp(-1e9 - m) == 0 exactly);
    it differs where masked slots hold garbage, as an uninitialised paged KV cache does. The fault runs
    the consistent kernel with the mask added and values not selected over such a cache: NaN leaks.
    The control keeps the garbage and the selection: no divergence at all (rule 1 at work)."""
    training, rollout = pair("dense")
    inject_fault(rollout, "additive-mask", layer=0)
    report = run(training, rollout)
    d = report.first_divergence
    assert (d.layer, d.op, d.category) == (0, "model.layers.0.self_attn.attention", "implementation")
    assert any("non-finite" in x for x in d.details) and "rule 1" in d.fix
    assert report.logprobs["max_abs"] == float("inf")

    training, rollout = pair("dense")
    inject_fault(rollout, "kv-garbage", layer=0)
    assert run(training, rollout).first_divergence is None


def test_router_tie_break_reversed_is_an_operator_divergence_of_the_top_k():
    """Router rows of experts 0 and 1 are zeroed on BOTH copies, so their logits tie at exactly 0 and
    the tie decides the top-2 whenever one other expert scores above 0. The rollout copy's router
    module, config and weights are untouched; only the top-k kernel under it breaks ties towards the
    higher index (as a different serving kernel would): equal inputs (the router logits), equal
    parameters and configuration, different outputs -> ``operator``."""
    training, rollout = pair("moe", ties_layer=1)
    inject_fault(rollout, "router-tiebreak", layer=1)
    report = run(training, rollout)
    d = report.first_divergence
    assert (d.layer, d.op, d.category) == (1, "model.layers.1.mlp.gate.topk", "operator")
    assert d.kind == "topk" and d.details == [] and "rule 2" in d.fix
    assert row(report, "model.layers.1.mlp.gate").equal  # the router logits themselves tie bitwise
    assert row(report, "model.layers.1.mlp.gate.topk").tokens_differing > 0
    assert row(report, "model.layers.0.mlp.gate.topk").equal


# ----------------------------------------------------------------------------------------------
# the classifier on its own (parallel is not exercised by two full copies in one process)
# ----------------------------------------------------------------------------------------------


def test_classifier_priority_parallel_weights_implementation_operator():
    def model():
        torch.manual_seed(0)
        m = nn.Module()
        m.proj = nn.Linear(4, 4)
        return m

    def classify(a, b):
        return compare._classify("proj", "linear", None, a, b, capture._Side(a, "training"), capture._Side(b, "rollout"))

    a, b = model(), model()
    assert classify(a, b) == ("operator", [])
    b.proj.eps = 1e-3
    a.proj.eps = 1e-6
    assert classify(a, b)[0] == "implementation"
    with torch.no_grad():
        b.proj.weight[0, 0] += 1
    category, details = classify(a, b)
    assert category == "weights" and any("eps" in x for x in details)  # all evidence is kept
    b.proj.tp_size, b.proj.tp_rank = 2, 1  # a tensor-parallel shard's attributes
    category, details = classify(a, b)
    assert category == "parallel" and any("tp_size" in x for x in details)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def test_cli_writes_json_and_plot_and_rejects_bad_input(tmp_path, capsys):
    from true_on_policy.cli.diagnose import main

    out_json, out_png = tmp_path / "report.json", tmp_path / "report.png"
    argv = ["--inject", "eps", "--prompts", "2", "--new-tokens", "3", "--json", str(out_json), "--plot", str(out_png)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "FIRST DIVERGENCE: layer 1, op model.layers.1.post_attention_layernorm, category implementation" in text
    data = json.loads(out_json.read_text())
    assert data["first_divergence"]["op"] == "model.layers.1.post_attention_layernorm"
    assert data["first_divergence"]["category"] == "implementation"
    assert {"op", "layer", "max_abs", "mean_abs"} <= set(data["table"][0])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    for bad in (
        ["--prompts", "0"],
        ["--checkpoint", str(tmp_path / "missing")],
        ["--model", "dense", "--checkpoint", str(tmp_path)],
        ["--inject", "bf16-softmax", "--no-deterministic"],
        ["--inject", "router-tiebreak"],  # the dense model has no router
        ["--layer", "7"],
        ["--dtype", "float16"],
    ):
        assert main(bad) == 2, bad
    err = capsys.readouterr().err
    assert "no MoE router" in err and "not a directory" in err
