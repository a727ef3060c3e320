"""The asynchronous single-rollout sampler in verl's real colocate_async trainer, on CPU.

The e2e tests run ``python -m verl.trainer.main_ppo --config-name=cpu_tiny_async`` in a subprocess
(Ray, the FSDP engine on gloo, the CPU rollout engine, TransferQueue) and read the per-step metrics
from verl's file logger (shared runs, tests/support/verl_run.py). The sampler's configuration errors,
without starting anything: tests/unit/test_async_sampler.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_run import CPU_TINY_ASYNC, Run, train_steps

SUPPORT = Path(__file__).resolve().parents[1] / "support"
FAIL_ENV_VAR = "TOP_TEST_FAIL_FIRST_ROLLOUTS"  # fail_first_rollouts_agent_loop.FAIL_ENV_VAR (not importable here)

CONFIG = "cpu_tiny_async"
STEPS = 4
BATCH = 8  # data.train_batch_size in configs/common/cpu_tiny.yaml
PREFIX = "flashreinforce/sampler"
HISTOGRAM = [f"{PREFIX}/policy_lag_hist/{bucket}" for bucket in ("lag_0", "lag_1", "lag_2", "lag_ge_3")]


def check_lag_metrics(step: int, metrics: dict[str, float], max_policy_lag: int) -> None:
    lag_min, lag_mean, lag_max = (metrics[f"{PREFIX}/policy_lag/{stat}"] for stat in ("min", "mean", "max"))
    assert 0 <= lag_min <= lag_mean <= lag_max <= max_policy_lag, (step, lag_min, lag_mean, lag_max)
    # The histogram counts every trajectory of the batch once.
    assert sum(metrics[key] for key in HISTOGRAM) == BATCH, (step, [metrics[key] for key in HISTOGRAM])
    assert metrics[f"{PREFIX}/policy_lag_hist/lag_{int(lag_max)}"] >= 1
    # verl computes the same quantity independently from the same tags: (step - 1) - min_global_steps.
    assert metrics["training/off_policy/trajectory_staleness_worst/max"] == lag_max
    assert metrics["training/off_policy/trajectory_staleness_worst/mean"] == pytest.approx(lag_mean)
    assert metrics[f"{PREFIX}/version_span/max"] >= 1
    # the fill is a measured wait that contains the part spent waiting on the lag bound
    assert metrics[f"{PREFIX}/fill_seconds"] > 0.0
    assert metrics[f"{PREFIX}/lag_wait_seconds"] <= metrics[f"{PREFIX}/fill_seconds"]
    # One rollout per prompt: a batch of 8 trajectories from 8 different prompts (epoch 0 of 256).
    assert metrics[f"{PREFIX}/distinct_prompts"] == BATCH
    assert metrics[f"{PREFIX}/epoch"] == 0
    # Nothing lost or duplicated: after k steps the learner has seen exactly k * B prompts of the epoch.
    assert metrics[f"{PREFIX}/epoch_delivered"] == step * BATCH


ASYNC = CPU_TINY_ASYNC
FAILURES = 3
# One launch for two claims: the lag bound 0 (stale trajectories dropped and re-queued) and failing
# rollouts (re-queued, none lost). The two re-queue reasons are counted apart (requeued/policy_lag,
# requeued/rollout_failure), so each test reads its own observable of a run configured as it claims.
FAILING_ROLLOUTS_LAG_BOUND_ZERO = Run(
    CONFIG,
    train_steps(STEPS)
    + (
        "trainer.v1.sampler.sampler_kwargs.max_policy_lag=0",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={SUPPORT / 'fail_first_rollouts_agent_loop.yaml'}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=fail_first_rollouts",
    ),
    env=((FAIL_ENV_VAR, str(FAILURES)),),
    pythonpath=(str(SUPPORT),),
)


@pytest.mark.e2e
def test_async_run_logs_policy_lag_within_the_bound(verl_runs):
    steps = verl_runs(ASYNC).metrics

    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, metrics in steps.items():
        check_lag_metrics(step, metrics, max_policy_lag=2)
        assert metrics[f"{PREFIX}/requeued/rollout_failure"] == 0
    # One warm-up batch is in flight ahead of the learner, so some batch trains on older weights.
    assert max(metrics[f"{PREFIX}/policy_lag/max"] for metrics in steps.values()) >= 1


@pytest.mark.e2e
def test_lag_bound_zero_drops_stale_trajectories_and_requeues_their_prompts(verl_runs):
    steps = verl_runs(FAILING_ROLLOUTS_LAG_BOUND_ZERO).metrics

    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, metrics in steps.items():
        check_lag_metrics(step, metrics, max_policy_lag=0)
    # The warm-up batch finishes on version 0 and is too old by step 2: re-rolled, never trained on.
    assert sum(metrics[f"{PREFIX}/requeued/policy_lag"] for metrics in steps.values()) >= 1


@pytest.mark.e2e
def test_failed_rollouts_requeue_their_prompts_and_none_is_lost(verl_runs):
    """The first 3 prompts the agent loop sees fail once each (tests/support/fail_first_rollouts_agent_loop.py)."""
    steps = verl_runs(FAILING_ROLLOUTS_LAG_BOUND_ZERO).metrics

    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, metrics in steps.items():
        check_lag_metrics(step, metrics, max_policy_lag=0)
    # Each failure re-queued its prompt once; the re-roll succeeded and the epoch count stayed exact.
    assert sum(metrics[f"{PREFIX}/requeued/rollout_failure"] for metrics in steps.values()) == FAILURES
