"""The vLLM adapter's model check over vLLM's own model objects, built on CPU for every covered
architecture, with the DEVICE attention classes (the CUDA ``kernels: project`` path); for the hybrid (Gated
DeltaNet) models also the layer's forward on the op's torch code -- what ``forward_cuda`` runs on a GPU -- against
its C++ call.

One subprocess (tests/support/vllm_model_check.py, ~30 s: vLLM's import) builds the models without
an engine or weights; every assertion below reads its one JSON report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from true_on_policy import tiny_assets

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "vllm_model_check.py"
# the MoE first: vLLM creates its expert-parallel group only for a MoE model
KINDS = ("moe", "dense", "qwen2", "llama")
HYBRID_KINDS = ("qwen35", "qwen35_moe")  # after the Llama with biases: the report's first five entries keep their places


def _llama_biased_tied(directory: Path) -> str:
    """Another Llama shape: q/k/v/o and MLP biases, tied head, 6 query heads over 3 kv heads, linear RoPE."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=160, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                intermediate_size=128, num_hidden_layers=2, attention_bias=True, mlp_bias=True,
                tie_word_embeddings=True, max_position_embeddings=256, architectures=["LlamaForCausalLM"],
                rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}).save_pretrained(directory)
    tiny_assets.build_tokenizer().save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tiny_assets.ensure_assets()
    paths = [str(root / tiny_assets.MODEL_DIRS[kind]) for kind in KINDS]
    paths.append(_llama_biased_tied(tmp_path_factory.mktemp("llama_biased_tied")))
    paths += [str(root / tiny_assets.MODEL_DIRS[kind]) for kind in HYBRID_KINDS]
    out = subprocess.run([sys.executable, str(SCRIPT), *paths], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return list(json.loads(out.stdout.strip().splitlines()[-1]).values())


@pytest.mark.subprocess
def test_vllm_builds_the_device_attention_and_the_model_check_accepts_it_on_cuda(report):
    """The fix: the check asks for the implementation the device's backend builds (DeviceAttentionImpl
    for CUDA, a subclass of the CPU one), not for exactly ConsistentAttentionImpl."""
    assert [r["model"] for r in report] == [
        "Qwen3MoeForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "LlamaForCausalLM",
        "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]
    for r in report:
        assert r["attention_impls"] == ["DeviceAttentionImpl"], r
        assert r["verify"]["cuda"] == "ok", r


@pytest.mark.subprocess
def test_twin_the_cpu_rule_refuses_the_device_attention(report):
    """Without the fix (the check requiring exactly ConsistentAttentionImpl, today's CPU rule) the
    same models are refused: the CUDA kernels: project path could not start."""
    for r in report:
        assert r["verify"]["cpu"].startswith("UnsupportedFeatureError"), r
        assert "attention implementation DeviceAttentionImpl on cpu" in r["verify"]["cpu"], r


@pytest.mark.subprocess
def test_vllm_builds_what_each_architecture_entry_describes(report):
    for r in report:
        assert all(r["built"][key] == r["described"][key] for key in r["built"]), r
    llama3, biased = report[3], report[4]
    assert llama3["rope_classes"] == ["ConsistentLlama3RotaryEmbedding"]
    assert biased["rope_classes"] == ["ConsistentLinearScalingRotaryEmbedding"]
    assert biased["built"] == {"qkv_bias": True, "o_bias": True, "qk_norm": False, "mlp_bias": True, "rotary_dim": 16,
                               "linear_attention": None, "shared_expert": False}
    assert report[2]["built"]["qkv_bias"] and not report[2]["built"]["o_bias"]  # Qwen2: QKV bias only


@pytest.mark.subprocess
def test_a_gated_deltanet_layer_is_accepted_where_it_dispatches_to_the_adapters_forward(report):
    """The hybrid models pass the CUDA model check: each Gated DeltaNet layer's dispatch (bound by vLLM's __init__,
    forward_cpu here, forward_cuda on a GPU) is the adapter's replacement. Twin: the same layer dispatching to
    vLLM's own method again is refused, naming it."""
    for r in report[5:]:
        assert r["verify"]["cuda"] == "ok", r
        assert "Gated DeltaNet dispatching to vLLM's own forward_cpu on cuda" in r["verify"]["stock_gdn"], r


@pytest.mark.subprocess
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gated_deltanet_forward_on_the_torch_code_gives_the_cpp_calls_bits(report, dtype):
    """vLLM's Gated DeltaNet layer (the tiny Qwen3.5's, weights from a seed) through three scheduler steps -- fresh
    prefills, a decode beside a continuing and a fresh prefill, decodes -- with vLLM's metadata and state slots:
    the op's torch code (what the adapter's forward_cuda runs on a GPU) gives the C++ call's outputs and slots,
    torch.equal. Twin: the continuing prefill entering without its state changes its rows and no other."""
    gdn = report[5]["gdn"][dtype]
    assert gdn == {"dispatch": "gdn_forward", "native_ran": True, "equal": True, "nonzero": True,
                   "twin_differs_in_its_rows_only": True}, gdn
