"""For the tests that call verl's FlashREINFORCE path directly (no trainer launch): verl's FSDP actor
config as the registered loss sees it, the registered advantage estimator, and the small linear
softmax policy those tests train."""

from __future__ import annotations

import torch


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


def current_log_probs(features, weight, tokens):
    """The linear softmax policy's log-prob of each token: log_softmax(features @ weight)[token]."""
    return torch.log_softmax(features @ weight, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def verl_advantages(batch):
    """verl's registered ``flashreinforce`` advantage estimator on ``batch``'s rewards and mask."""
    from true_on_policy.verl_adapter import flashreinforce_registration  # noqa: F401  (registers)
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    advantages, _ = get_adv_estimator_fn("flashreinforce")(
        token_level_rewards=batch["token_level_rewards"], response_mask=batch["mask"].long(), config=None
    )
    return advantages
