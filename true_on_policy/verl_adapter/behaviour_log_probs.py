"""FlashREINFORCE's behaviour log-probs in verl 0.9.1: the rollout engine's recorded ones.

The gate and the importance ratio compare the current policy with the policy that SAMPLED each
token, so the loss must see the log-probs the rollout engine recorded at sampling time, never a
recomputation. verl 0.9.1 hands a registered policy loss only ``old_log_prob`` (``ppo_loss``
selects response_mask, old_log_probs, advantages, rollout_is_weights, ref_log_prob), so the sound
carrier is ``old_log_probs`` itself. The options verl offers, and why this module exists:

- ``algorithm.rollout_correction.bypass_mode=true`` copies ``rollout_log_probs`` into
  ``old_log_probs`` (in the v1 trainer it leaves ``loss_mode`` alone; the legacy trainer's
  ``apply_bypass_mode`` forces ``loss_mode="bypass_mode"``), but it also skips verl's recompute,
  and with it the true-on-policy monitor ``training/rollout_probs_diff_*``;
- decoupled mode (bypass off) passes the loss only ``rollout_is_weights`` = exp(old - rollout),
  possibly truncated: the behaviour log-prob cannot be recovered exactly from it.

So the v1 trainer's ``_compute_old_log_prob`` runs as verl wrote it (the training engine
recomputes the log-probs and logs ``training/rollout_probs_diff_*`` against the rollout's), then
``old_log_probs`` is overwritten with ``rollout_log_probs``, exactly the copy bypass mode makes.
Installed only in a process whose launch configured the recipe.
"""

from __future__ import annotations

import functools


def use_rollout_log_probs_as_old(batch, tq) -> None:
    """Overwrite ``old_log_probs`` with the recorded ``rollout_log_probs`` in the TransferQueue."""
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["rollout_log_probs"])
    if "rollout_log_probs" not in data.keys():
        raise ValueError(
            "FlashREINFORCE needs the rollout engine's sampling log-probs: "
            "set actor_rollout_ref.rollout.calculate_log_probs=true"
        )
    data["old_log_probs"] = data.pop("rollout_log_probs")
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=data)


@functools.cache
def install() -> None:
    import transfer_queue as tq
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    recompute_old_log_prob = PPOTrainer._compute_old_log_prob

    @functools.wraps(recompute_old_log_prob)
    def compute_old_log_prob(self, batch, metrics):
        batch = recompute_old_log_prob(self, batch, metrics)
        use_rollout_log_probs_as_old(batch, tq)
        return batch

    PPOTrainer._compute_old_log_prob = compute_old_log_prob
