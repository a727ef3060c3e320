"""The sync replay buffer without verl's fixed 2 s poll (true_on_policy.verl_adapter.sync_sampler).

The buffer is built by verl's own ``PPOTrainer._build_replay_buffer`` from the recipe's composed
config, on a v1 trainer instance that is never ``__init__``-ed (building the buffer needs only the
config and the bound refill function). The end-to-end effect on ``timing_s/gen`` is asserted in
tests/e2e/test_e2e_cpu_trainer.py.
"""

from pathlib import Path

import pytest

from true_on_policy.cli.check import compose_config
from true_on_policy.verl_adapter.sync_sampler import SyncReplayBuffer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def build_replay_buffer(*overrides: str):
    from verl.trainer.ppo.v1 import get_trainer_cls

    config = compose_config(str(CONFIGS), "cpu_tiny", overrides)
    trainer = object.__new__(get_trainer_cls(config.trainer.v1.trainer_mode))
    trainer.config = config
    trainer.trainer_mode = config.trainer.v1.trainer_mode
    return trainer._build_replay_buffer()


def test_shipped_config_polls_every_20_ms():
    buffer = build_replay_buffer()
    assert type(buffer) is SyncReplayBuffer
    assert buffer.poll_interval == 0.02


def test_twin_verl_builtin_buffer_polls_every_2_s():
    """Without the recipe's sampler verl builds its own buffer with the fixed 2 s poll: the floor."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    buffer = build_replay_buffer("trainer.v1.sampler.custom_sampler=null", "trainer.v1.sampler.sampler_kwargs={}")
    assert type(buffer) is ReplayBuffer
    assert buffer.poll_interval == 2.0


def test_poll_interval_is_configurable():
    buffer = build_replay_buffer("trainer.v1.sampler.sampler_kwargs.poll_interval_s=0.5")
    assert buffer.poll_interval == 0.5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("trainer.v1.sampler.sampler_kwargs.poll_interval_s=0",), "poll_interval_s must be a number > 0, got 0"),
        (("trainer.v1.sampler.sampler_kwargs.poll_interval_s=soon",), "got 'soon'"),
        (("+trainer.v1.sampler.sampler_kwargs.max_policy_lag=1",), "unknown key(s) ['max_policy_lag']"),
        (("trainer.v1.trainer_mode=colocate_async",), "trainer.v1.trainer_mode='colocate_async'"),
    ],
)
def test_bad_settings_are_errors_naming_key_and_value(overrides, message):
    with pytest.raises(ValueError) as error:
        build_replay_buffer(*overrides)
    assert message in str(error.value)
