"""FlashREINFORCE in verl 0.9.1's registries (``verl.trainer.ppo.core_algos``).

* advantage estimator ``flashreinforce`` (``algorithm.adv_estimator=flashreinforce``):
  A_i = R_i - batch mean, broadcast over the response and multiplied by ``response_mask``;
* policy loss ``flashreinforce`` (``actor_rollout_ref.actor.policy_loss.loss_mode=flashreinforce``).

Both delegate the math to :mod:`true_on_policy.loss.flashreinforce`; this module only translates verl's
calling conventions. verl calls the policy loss once per micro-batch (workers/utils/losses.py
``ppo_loss``), with ``old_log_prob`` = the batch's ``old_log_probs``, which in this project are the
rollout engine's recorded sampling log-probs: the behaviour log-probs of the gate and the ratio.

The entropy filter (``true_on_policy.negative_token_fraction`` q < 1). verl 0.9.1's policy-loss call
carries no entropies and no rewards; of the per-token fields ``ppo_loss`` forwards (old_log_probs,
advantages, rollout_is_weights) only ``rollout_is_weights`` is free: the gate replaces importance
weighting, so verl's rollout correction is refused anyway (invariant ``no_rollout_correction``).
The trainer hook (:mod:`true_on_policy.verl_adapter.trainer_hooks`) therefore writes the
filter's keep decisions, computed in the driver by :func:`true_on_policy.loss.flashreinforce.entropy_filter`
from the recompute's token entropies and the sequence rewards, into the batch's
``rollout_is_weights`` field, and this loss reads that field as the FILTER MASK, never as weights:

* q < 1: ``rollout_is_weights`` must be present, shaped like ``response_mask``, exactly 0 or 1,
  0 outside the response, and keep T_i or ceil(q * T_i) tokens in each row (a successful or a
  failed row); anything else is refused. Importance weights that are all exactly 1 (what they are
  when training and rollout agree bitwise) would read as "no row failed", so real weights must
  never reach this field: the launch refuses ``rollout_is`` (invariant ``no_rollout_correction``)
  and the trainer hook refuses to write its mask over weights verl already wrote;
* q = 1: ``rollout_is_weights`` must be absent; real importance weights are refused as before.

Both refuse to run without the settings the launch validated and exported (no defaults).

The denominators stay the ORIGINAL B and T_i (``flashreinforce_loss_from_advantages(kept_tokens=)``).
"""

from __future__ import annotations

from typing import Any

import torch
from verl.trainer.ppo.core_algos import register_adv_est, register_policy_loss

from true_on_policy.config import settings as settings_module
from true_on_policy.loss.flashreinforce import flashreinforce_loss_from_advantages, kept_token_count, sequence_advantages

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
    of the mean and get advantage 0.
    """
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask {tuple(response_mask.shape)} "
            "must both be [bs, response_length]"
        )
    settings_module.require("adv_estimator=flashreinforce")
    with torch.no_grad():
        mask = response_mask.bool()
        # As verl's outcome estimators do: the sequence reward is the sum over the response.
        sequence_rewards = token_level_rewards.sum(dim=-1)
        trajectories = mask.any(dim=-1)
        if not bool(trajectories.any()):
            raise ValueError("flashreinforce advantage: the batch has no row with a response token")
        advantages = torch.zeros_like(sequence_rewards)
        advantages[trajectories] = sequence_advantages(sequence_rewards[trajectories])
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
) -> tuple[torch.Tensor, dict[str, float]]:
    """FlashREINFORCE loss of one micro-batch, scaled so verl's accumulation yields the whole-batch loss.

    verl sums the gradients of successive micro-batches and FSDP averages them over the dp ranks, so
    each micro-batch contributes ``dp_size * flashreinforce_loss_from_advantages(rows, batch_size=
    global_batch_size)``: summed over micro-batches and averaged over ranks, that is exactly the pure
    loss of the whole batch. ``config`` is the actor's ActorConfig; ``ppo_loss`` refreshes its
    ``global_batch_info`` (dp_size, batch_num_tokens, global_batch_size) before every call.
    """
    if loss_agg_mode != SAMPLE_MEAN:
        raise ValueError(
            f"loss_mode=flashreinforce needs actor_rollout_ref.actor.loss_agg_mode='{SAMPLE_MEAN}' "
            f"(mean over tokens within a trajectory, then over trajectories); got {loss_agg_mode!r}"
        )
    if config is None or not hasattr(config, "global_batch_info"):
        raise ValueError("loss_mode=flashreinforce needs verl's actor config (with global_batch_info) as `config`")
    settings = settings_module.require("loss_mode=flashreinforce")
    fraction = settings.negative_token_fraction
    if fraction >= 1.0 and rollout_is_weights is not None:
        raise ValueError(
            "loss_mode=flashreinforce received rollout importance weights; its trust-region gate replaces them. "
            "Set algorithm.rollout_correction.rollout_is=null."
        )

    global_batch_info = config.global_batch_info
    dp_size = global_batch_info.get("dp_size", 1) or 1
    global_batch_size = global_batch_info.get("global_batch_size")
    if global_batch_size is None:
        raise ValueError(
            "loss_mode=flashreinforce needs config.global_batch_info['global_batch_size'] (verl's ppo_loss sets it "
            "from the mini-batch): the loss is a mean over the whole learner batch, not over a micro-batch"
        )

    mask = response_mask.bool()
    rows_with_response = mask.any(dim=-1)
    sequence_advantage = _sequence_advantage(advantages, mask)
    kept_tokens = filter_mask(rollout_is_weights, mask, fraction) if fraction < 1.0 else None

    if not bool(rows_with_response.any()):
        # Only verl's synthetic padding rows: nothing to learn, but backward() still needs a graph.
        zero = torch.where(mask, log_prob, torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)).sum()
        return zero, _metrics(None)

    if not bool(rows_with_response.all()):
        log_prob, old_log_prob = log_prob[rows_with_response], old_log_prob[rows_with_response]
        sequence_advantage, mask = sequence_advantage[rows_with_response], mask[rows_with_response]
        if kept_tokens is not None:
            kept_tokens = kept_tokens[rows_with_response]

    loss, stats = flashreinforce_loss_from_advantages(
        log_prob,
        old_log_prob,
        sequence_advantage,
        mask,
        batch_size=int(global_batch_size),
        delta=settings.delta,
        kept_tokens=kept_tokens,
    )
    return loss * dp_size, _metrics(stats)


def filter_mask(carrier: torch.Tensor | None, response_mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """The entropy filter's keep decisions from their carrier (``rollout_is_weights``), validated.

    ``response_mask`` is the micro-batch's bool [rows, T]; ``fraction`` is q < 1. Returns bool
    [rows, T]. Refuses a missing carrier (the trainer hook did not run), a wrong shape, any value
    other than exactly 0 or 1, a kept position outside the response, and a row that keeps neither
    all its T_i tokens (a successful row) nor ceil(q * T_i) of them (a failed row).
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
    ones, zeros = carrier == 1, carrier == 0
    if not bool((ones | zeros).all()):
        bad = torch.nonzero(~(ones | zeros))[:5].tolist()
        raise ValueError(
            f"'{FILTER_MASK_FIELD}' must be the entropy filter's 0/1 keep mask when negative_token_fraction < 1, "
            f"but holds other values (importance weights?) at [row, position] {bad}; "
            "rollout importance weighting is not supported: set algorithm.rollout_correction.rollout_is=null"
        )
    kept = ones
    outside = kept & ~response_mask
    if bool(outside.any()):
        bad = torch.nonzero(outside)[:5].tolist()
        raise ValueError(f"the entropy filter mask keeps positions outside the response: [row, position] {bad}")
    policy_tokens = response_mask.sum(dim=-1).tolist()
    for row, (count, total) in enumerate(zip(kept.sum(dim=-1).tolist(), policy_tokens)):
        if count not in (total, kept_token_count(fraction, total)):
            raise ValueError(
                f"the entropy filter mask keeps {count} of the {total} response tokens of row {row}; with "
                f"negative_token_fraction={fraction} a row keeps all of them (success) or "
                f"{kept_token_count(fraction, total)} (failure)"
            )
    return kept


def _sequence_advantage(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A_i read at the first response token; it must be the same at every response token of the row."""
    first_response_token = mask.to(torch.int32).argmax(dim=-1, keepdim=True)
    per_row = advantages.gather(1, first_response_token)
    varies = mask & (advantages != per_row)
    if bool(varies.any()):
        rows = torch.nonzero(varies.any(dim=-1)).flatten()[:5].tolist()
        raise ValueError(
            f"loss_mode=flashreinforce needs one advantage per trajectory, but it varies within rows {rows}; "
            "use algorithm.adv_estimator=flashreinforce"
        )
    return per_row.squeeze(-1).detach()


def _metrics(stats: dict[str, torch.Tensor] | None) -> dict[str, float]:
    # verl wraps these as Metric(MEAN) and averages them over micro-batches and ranks; it also needs
    # every key on every micro-batch of every rank, so a padding-only micro-batch reports zeros.
    if stats is None:
        return dict.fromkeys(METRIC_NAMES, 0.0)
    policy_tokens = stats["policy_tokens"].sum()
    return {
        METRIC_PREFIX + "acceptance_rate": stats["acceptance_rate"].item(),
        METRIC_PREFIX + "sequence_kl_mean": stats["sequence_kl"].mean().item(),
        METRIC_PREFIX + "retained_token_fraction": (stats["retained_tokens"].sum() / policy_tokens).item(),
        METRIC_PREFIX + "ratio_deviation_mean": stats["ratio_deviation"].item(),
    }
