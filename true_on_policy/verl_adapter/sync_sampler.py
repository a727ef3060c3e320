"""verl's synchronous replay buffer without its fixed 2-second poll.

verl 0.9.1's ``ReplayBuffer`` sleeps ``poll_interval`` (a constructor default of 2.0 s that no config
key reaches) between TransferQueue listings while the batch fills, and its first listing comes before
any rollout can finish, so every step waits at least one interval. :class:`SyncReplayBuffer` is
the same buffer with the interval from ``trainer.v1.sampler.sampler_kwargs.poll_interval_s``, plugged
in through verl's public ``trainer.v1.sampler.custom_sampler`` hook (nothing patched). It takes no
DAPO group filter: FlashREINFORCE has no groups.
"""

from __future__ import annotations

from collections.abc import Mapping

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

SAMPLER_KWARGS_DEFAULTS = {"poll_interval_s": 0.02}


def merge_sampler_kwargs(sampler_kwargs: Mapping | None, defaults: Mapping, owner: str) -> dict:
    """``sampler_kwargs`` over ``defaults``: an unknown key, or a ``poll_interval_s`` that is not a number
    > 0, is an error naming it. Shared by every sampler this plugin plugs into verl."""
    given = dict(sampler_kwargs or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(
            f"trainer.v1.sampler.sampler_kwargs has unknown key(s) {unknown} for {owner}; known: {sorted(defaults)}"
        )
    settings = {**defaults, **given}
    poll = settings["poll_interval_s"]
    if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not poll > 0:
        raise ValueError(f"trainer.v1.sampler.sampler_kwargs.poll_interval_s must be a number > 0, got {poll!r}")
    return settings


def parse_sampler_kwargs(sampler_kwargs: Mapping | None) -> dict:
    """Validated ``trainer.v1.sampler.sampler_kwargs``; an unknown key or a bad value is an error."""
    return merge_sampler_kwargs(sampler_kwargs, SAMPLER_KWARGS_DEFAULTS, SyncReplayBuffer.__name__)


class SyncReplayBuffer(ReplayBuffer):
    """verl's sync ``ReplayBuffer``, polling TransferQueue every ``poll_interval_s`` (see the module doc)."""

    def __init__(self, trainer_mode: str, sampler_kwargs, **verl_kwargs):
        """verl builds a sampler by keyword (``trainer_base``: ``sampler_cls(**replay_buffer_kwargs)``); what
        this buffer does not read (the trainer config, the off-policy settings, ``refill_fn``) goes to verl's."""
        if trainer_mode != "sync":
            raise ValueError(
                f"{type(self).__name__} is the sync trainer's replay buffer; trainer.v1.trainer_mode={trainer_mode!r} "
                "needs an async sampler (true_on_policy.verl_adapter.async_sampler.SingleRolloutAsyncSampler)"
            )
        if "poll_interval" in verl_kwargs:
            raise ValueError("pass the poll interval as trainer.v1.sampler.sampler_kwargs.poll_interval_s")
        self.settings = parse_sampler_kwargs(sampler_kwargs)
        super().__init__(
            trainer_mode=trainer_mode,
            sampler_kwargs=sampler_kwargs,
            poll_interval=float(self.settings["poll_interval_s"]),
            **verl_kwargs,
        )


__all__ = ["SyncReplayBuffer", "parse_sampler_kwargs"]
