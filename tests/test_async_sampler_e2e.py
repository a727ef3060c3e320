"""The asynchronous single-rollout sampler in verl's real colocate_async trainer, on CPU.

The e2e tests run ``python -m verl.trainer.main_ppo --config-name=cpu_tiny_async`` in a subprocess
(Ray, the FSDP engine on gloo, the CPU rollout engine, TransferQueue) and read the per-step metrics
from verl's file logger (shared runs, tests/verl_run.py). The unmarked tests at the end check the
sampler's configuration errors without starting anything.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_run import CPU_TINY_ASYNC, REPO, Run, train_steps

SUPPORT = Path(__file__).resolve().parent / "support"
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


# ---------------------------------------------------------------------- configuration errors (no Ray)
def _unstarted_trainer(mode="colocate_async"):
    """An instance of verl's real v1 trainer class, never ``__init__``-ed: the owner of ``refill_fn``."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    return object.__new__(get_trainer_cls(mode))


def _sampler(**overrides):
    from true_on_policy.verl_adapter.async_sampler import SingleRolloutAsyncSampler

    arguments = dict(
        trainer_mode="colocate_async",
        trainer_config={},
        max_off_policy_threshold=None,
        max_off_policy_strategy="drop",
        sampler_kwargs={"max_policy_lag": 2, "lag_strategy": "drop"},
        refill_fn=_unstarted_trainer()._add_prompts_to_generate,
    )
    arguments.update(overrides)
    return SingleRolloutAsyncSampler(**arguments)


def test_sampler_accepts_the_shipped_settings():
    """The sampler built from the shipped cpu_tiny_async.yaml the way verl's trainer builds it."""
    from omegaconf import OmegaConf

    from true_on_policy.cli.check import compose_config
    from true_on_policy.verl_adapter.async_sampler import SingleRolloutAsyncSampler, parse_sampler_kwargs

    config = compose_config(str(REPO / "configs"), CONFIG)
    v1 = config.trainer.v1
    sampler_config = v1.sampler
    assert (sampler_config.custom_sampler.path, sampler_config.custom_sampler.name) == (
        "pkg://true_on_policy.verl_adapter.async_sampler",
        SingleRolloutAsyncSampler.__name__,
    )
    trainer = _unstarted_trainer(v1.trainer_mode)
    sampler = SingleRolloutAsyncSampler(
        trainer_mode=v1.trainer_mode,
        trainer_config=v1.get(v1.trainer_mode, {}),
        max_off_policy_threshold=sampler_config.max_off_policy_threshold,
        max_off_policy_strategy=sampler_config.max_off_policy_strategy,
        sampler_kwargs=sampler_config.sampler_kwargs,
        refill_fn=trainer._add_prompts_to_generate,
    )
    shipped = OmegaConf.to_container(sampler_config.sampler_kwargs)
    assert sampler.settings == parse_sampler_kwargs(shipped)
    assert (sampler.max_policy_lag, sampler.lag_strategy) == (shipped["max_policy_lag"], shipped["lag_strategy"])
    assert sampler._trainer is trainer


def test_a_refill_fn_that_is_not_the_trainers_is_refused():
    class Stranger:
        def _add_prompts_to_generate(self, num_prompts):
            return num_prompts

    with pytest.raises(RuntimeError, match="not the bound _add_prompts_to_generate of a v1 PPOTrainer"):
        _sampler(refill_fn=Stranger()._add_prompts_to_generate)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"trainer_mode": "sync"}, "needs an async v1 trainer"),
        ({"max_off_policy_threshold": 8}, "set max_off_policy_threshold=null"),
        ({"refill_fn": None}, "re-dispatches prompts through the trainer's agent loop"),
        ({"sampler_kwargs": {"max_policy_lag": -1}}, "max_policy_lag must be an int >= 0"),
        ({"sampler_kwargs": {"max_policy_lag": 1, "lag_strategy": "skip"}}, "lag_strategy must be one of"),
        ({"sampler_kwargs": {"lag_strategy": "wait"}}, "max_policy_lag is null"),
        ({"sampler_kwargs": {"poll_interval_s": 0}}, "poll_interval_s must be a number > 0"),
        ({"sampler_kwargs": {"rollout_timeout_s": -5}}, "rollout_timeout_s must be a number > 0"),
        ({"sampler_kwargs": {"lag_histogram_buckets": 1}}, "lag_histogram_buckets must be an int >= 2"),
        ({"sampler_kwargs": {"max_lag": 2}}, r"unknown key\(s\) \['max_lag'\]"),
        ({"sampler_kwargs": {"max_rollout_failures": 0}}, "max_rollout_failures must be an int >= 1"),
    ],
)
def test_bad_sampler_settings_name_the_problem(overrides, message):
    with pytest.raises(ValueError, match=message):
        _sampler(**overrides)


def test_a_prompt_failing_max_rollout_failures_times_stops_the_run_by_name():
    """A dead rollout server fails every request at once: re-queuing must not loop forever."""
    from true_on_policy.rollout.prompt_ledger import PromptLedger
    from true_on_policy.verl_adapter.async_sampler import RolloutFailuresError

    sampler = _sampler(sampler_kwargs={"max_rollout_failures": 3})
    sampler.ledger = ledger = PromptLedger(prompts_per_epoch=4)
    ledger.dispatched("a0", prompt_id=7, dispatch_step=1, now=0.0)
    for attempt in range(2):  # failures 1 and 2 re-queue the prompt
        assert ledger.failed(f"a{attempt}") == "requeue"
        sampler._check_failures(f"a{attempt}", "failed")
        ledger.requeued(f"a{attempt}", f"a{attempt + 1}", dispatch_step=1, now=0.0)
    assert ledger.failed("a2") == "requeue"
    with pytest.raises(RolloutFailuresError, match=r"prompt 7 \(epoch 0\) failed 3 times.*max_rollout_failures=3"):
        sampler._check_failures("a2", "failed")
