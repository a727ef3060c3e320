"""FlashREINFORCE in verl 0.9.1's registries (``verl.trainer.ppo.core_algos``).

* advantage estimator ``flashreinforce``: A_i = R_i - batch mean, broadcast over the response,
  times ``response_mask``;
* policy loss ``flashreinforce``: behaviour log-probs = ``old_log_prob`` (the rollout's recorded
  ones, see :mod:`.trainer_hooks`); ``rollout_is_weights`` is read as the entropy filter's 0/1 mask,
  never as weights (present iff ``negative_token_fraction`` < 1).

Both only translate verl's calling conventions; the math is :mod:`true_on_policy.loss.flashreinforce`
(denominators: the original B and T_i). No host sync per micro-batch: no tensor value is read on
the host (the driver validated the batch once); a non-finite active ratio is a device-side assert.
Both refuse to run without the launch's exported settings. Details: docs/flashreinforce.md.
"""

from __future__ import annotations

from typing import Any

import torch
from verl.trainer.ppo.core_algos import register_adv_est, register_policy_loss

from true_on_policy.config.settings import require
from true_on_policy.loss.flashreinforce import loss_core, masked_sequence_advantages

NAME = "flashreinforce"
SAMPLE_MEAN = "seq-mean-token-mean"
METRIC_PREFIX = "actor/flashreinforce/"
# The batch field that carries the entropy filter's keep decisions to the loss when q < 1
# (verl's ppo_loss forwards it as the policy loss's ``rollout_is_weights`` argument).
FILTER_MASK_FIELD = "rollout_is_weights"
METRIC_NAMES = (
    METRIC_PREFIX + "acceptance_rate",
    METRIC_PREFIX + "sequence_kl_mean",
    METRIC_PREFIX + "retained_token_fraction",
    METRIC_PREFIX + "ratio_deviation_mean",
)


@register_adv_est(NAME)
def compute_flashreinforce_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-mean baseline on sequence rewards; returns ``(advantages, returns)``, both [bs, response_length].

    verl calls this with keywords (trainer/ppo/ray_trainer.py ``compute_advantage``): token_level_rewards,
    response_mask, config, and optionally index (uid); the extras are not needed here.

    Rows with an empty ``response_mask`` are verl's synthetic padding samples (trainer/ppo/padding_utils.py,
    added so the batch divides across data-parallel ranks): they are not trajectories, so they stay out
    of the mean and get advantage 0. A batch without any trajectory (NaN advantages) and non-finite
    rewards are refused by the driver's per-batch check, not here (no host read).
    """
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask {tuple(response_mask.shape)} "
            "must both be [bs, response_length]"
        )
    require("adv_estimator=flashreinforce")
    with torch.no_grad():
        mask = response_mask.bool()
        # As verl's outcome estimators do: the sequence reward is the sum over the response.
        sequence_rewards = token_level_rewards.sum(dim=-1)
        advantages = masked_sequence_advantages(sequence_rewards, mask.any(dim=-1))
        token_advantages = advantages.unsqueeze(-1) * response_mask.to(advantages.dtype)
    return token_advantages, token_advantages


@register_policy_loss(NAME)
def compute_flashreinforce_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = SAMPLE_MEAN,
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """FlashREINFORCE loss of one micro-batch, scaled so verl's accumulation yields the whole-batch loss.

    verl sums the gradients of successive micro-batches and FSDP averages them over the dp ranks, so
    each micro-batch contributes ``dp_size * loss_core(rows, batch_size=global_batch_size)``: summed
    over micro-batches and averaged over ranks, that is exactly the pure loss of the whole batch.
    ``config`` is the actor's ActorConfig; ``ppo_loss`` refreshes its ``global_batch_info``
    (dp_size, batch_num_tokens, global_batch_size) before every call: both sizes are required.
    """
    if loss_agg_mode != SAMPLE_MEAN:
        raise ValueError(
            f"loss_mode=flashreinforce needs actor_rollout_ref.actor.loss_agg_mode='{SAMPLE_MEAN}' "
            f"(mean over tokens within a trajectory, then over trajectories); got {loss_agg_mode!r}"
        )
    if config is None or not hasattr(config, "global_batch_info"):
        raise ValueError("loss_mode=flashreinforce needs verl's actor config (with global_batch_info) as `config`")
    settings = require("loss_mode=flashreinforce")
    fraction = settings.negative_token_fraction
    if fraction >= 1.0 and rollout_is_weights is not None:
        raise ValueError(
            "loss_mode=flashreinforce received rollout importance weights; its trust-region gate replaces them. "
            "Set algorithm.rollout_correction.rollout_is=null."
        )
    dp_size = _required_batch_info(config.global_batch_info, "dp_size", "the gradient is averaged over the data-parallel ranks")
    global_batch_size = _required_batch_info(
        config.global_batch_info, "global_batch_size", "the loss is a mean over the whole learner batch, not over a micro-batch"
    )

    mask = response_mask.bool()
    kept_tokens = filter_mask(rollout_is_weights, mask, fraction) if fraction < 1.0 else None
    loss, stats, non_finite = loss_core(
        log_prob,
        old_log_prob,
        _sequence_advantage(advantages, mask),
        mask,
        batch_size=global_batch_size,
        delta=settings.delta,
        kept_tokens=kept_tokens,
    )
    # On a device this is checked there, without stopping the host; on CPU it raises here.
    torch._assert_async(
        ~non_finite.any(),
        "loss_mode=flashreinforce: the importance ratio exp(log_prob - old_log_prob) is not finite on an active token "
        "(the log-ratio overflows)",
    )
    return loss * dp_size, _metrics(stats)


def _required_batch_info(info, key: str, why: str) -> int:
    value = info.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"loss_mode=flashreinforce needs config.global_batch_info[{key!r}] (verl's ppo_loss sets it from the "
            f"mini-batch; {why}), got {value!r}"
        )
    return value


def filter_mask(carrier: torch.Tensor | None, response_mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """The entropy filter's keep decisions from their carrier (``rollout_is_weights``): bool [rows, T].

    Refuses a missing carrier (the trainer hook did not run) and a wrong shape; its values were
    validated once per batch in the driver (:func:`~.trainer_hooks.validate_flashreinforce_batch`).
    """
    if carrier is None:
        raise ValueError(
            f"true_on_policy.negative_token_fraction={fraction} needs the entropy filter's per-token keep mask, "
            f"which the trainer hook writes into the batch field '{FILTER_MASK_FIELD}'; the loss received none. "
            "Is the true_on_policy plugin active in the trainer process (launch with a true_on_policy: section)?"
        )
    if not isinstance(carrier, torch.Tensor) or tuple(carrier.shape) != tuple(response_mask.shape):
        found = tuple(carrier.shape) if isinstance(carrier, torch.Tensor) else type(carrier).__name__
        raise ValueError(
            f"the entropy filter mask ('{FILTER_MASK_FIELD}') must have the response's shape "
            f"{tuple(response_mask.shape)}, got {found}"
        )
    return (carrier == 1) & response_mask


def _sequence_advantage(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A_i read at the first response token (one advantage per row: checked once per batch in the driver)."""
    first_response_token = mask.to(torch.int32).argmax(dim=-1, keepdim=True)
    return advantages.gather(1, first_response_token).squeeze(-1).detach()


def _metrics(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # 0-dim tensors: verl wraps them as Metric(MEAN) (which reads each once) and averages them over
    # micro-batches and ranks; a padding-only micro-batch reports zeros (every key on every micro-batch).
    policy_tokens = stats["policy_tokens"].sum().clamp(min=1)
    return {
        METRIC_PREFIX + "acceptance_rate": stats["acceptance_rate"],
        METRIC_PREFIX + "sequence_kl_mean": stats["sequence_kl_mean"],
        METRIC_PREFIX + "retained_token_fraction": stats["retained_tokens"].sum() / policy_tokens,
        METRIC_PREFIX + "ratio_deviation_mean": stats["ratio_deviation"],
    }
