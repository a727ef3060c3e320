"""The asynchronous single-rollout sampler's configuration errors, without starting anything: built the way
verl's real colocate_async trainer builds it (its run on CPU: tests/e2e/test_async_sampler_e2e.py).
"""

from __future__ import annotations

import pytest

from verl_run import REPO

CONFIG = "cpu_tiny_async"


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
