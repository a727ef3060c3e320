"""verl's FSDP actor config as the registered FlashREINFORCE loss sees it, for the tests that call
verl's policy-loss path directly (no trainer launch)."""

from __future__ import annotations


def flashreinforce_actor_config(rows: int, *, dp_size: int | None = None, global_batch_size: int | None = None):
    """One mini-batch of ``rows`` trajectories in micro-batches of 2; with ``dp_size``, verl's
    ``global_batch_info`` filled as its trainer fills it (the loss requires dp_size and the global
    batch size)."""
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    config = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=rows,
        ppo_micro_batch_size_per_gpu=2,
        loss_agg_mode="seq-mean-token-mean",
        policy_loss=PolicyLossConfig(loss_mode="flashreinforce"),
    )
    if dp_size is not None:
        config.global_batch_info.update(
            dp_size=dp_size, batch_num_tokens=None, global_batch_size=global_batch_size, loss_scale_factor=None
        )
    return config
