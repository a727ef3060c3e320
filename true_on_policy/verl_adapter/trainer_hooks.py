"""Hooks on verl 0.9.1's v1 trainer (``PPOTrainer``) that FlashREINFORCE and true on-policy need.

1. :func:`use_rollout_log_probs_as_old`: after verl's recompute (which logs
   ``training/rollout_probs_diff_*``), ``old_log_probs`` := the rollout's recorded ``rollout_log_probs``.
2. :func:`write_entropy_filter_mask` (q < 1): the filter's keep decisions, from verl's recomputed
   entropies and ``rm_scores``, written as ``rollout_is_weights``; refuses to overwrite real weights.
3. :func:`canonical_order` (flag on): the batch sorted by token sequence before verl balances it.
4. :func:`require_full_batch`: a batch short of prompts raises :class:`ShortBatchError`, never padded.
5. :func:`validate_flashreinforce_batch`: host-side checks, once per batch, in the driver.
6. :func:`logprob_agreement`: where verl compares the recompute with the rollout's recorded log-probs
   (``training/rollout_probs_diff_*``, in probability space), the same tokens compared in log space, by
   bits: :data:`MISMATCHED_TOKENS_METRIC` and :data:`LOGPROB_DIFF_METRIC`, every step.

Hooks 1, 2 and 5 run only with ``loss_mode=flashreinforce``; 3, 4 and 6 serve every verl algorithm.
Installed only in a process whose launch configured the recipe. Why each hook exists and how verl
calls it: docs/flashreinforce.md ("The trainer hooks and the registered loss").
"""

from __future__ import annotations

import functools

import torch

from true_on_policy.config.settings import require
from true_on_policy.config.invariants import FLASHREINFORCE, LOSS_MODE_KEY
from true_on_policy.config.launch import lookup
from true_on_policy.loss.flashreinforce import entropy_filter, kept_token_count
from true_on_policy.verl_adapter.flashreinforce_registration import FILTER_MASK_FIELD, METRIC_PREFIX

# Driver-side metric: the fraction of the step's trajectories the filter treats as failed.
FAILED_FRACTION_METRIC = METRIC_PREFIX + "failed_fraction"
FILTER_INPUT_FIELDS = ("response_mask", "entropy", "rm_scores")
# Driver-side metrics, the training recompute vs the rollout's recorded log-probs, per response token.
MISMATCHED_TOKENS_METRIC = "logdiff/mismatched_tokens"
LOGPROB_DIFF_METRIC = "logdiff/abs_max"
VERL_DIFF_METRIC = "training/rollout_probs_diff_max"  # verl's, present when it compared the two
AGREEMENT_FIELDS = ("old_log_probs", "rollout_log_probs", "response_mask", "responses")


def logprob_agreement(training: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How many tokens under ``mask`` have a training log-prob whose fp32 bits differ from the rollout's
    (verl's probability-space metric cannot see one ulp: many adjacent log-probs share an ``exp``), and
    the largest |training - rollout| among them. One host transfer for both."""
    mask = mask.bool()
    training, rollout = training.float(), rollout.float()
    differ = (training.view(torch.int32) != rollout.view(torch.int32)) & mask
    gap = torch.where(mask, (training - rollout).abs(), torch.zeros_like(training))
    count, largest = torch.stack([differ.sum().float(), gap.amax() if gap.numel() else gap.new_zeros(())]).tolist()
    return {MISMATCHED_TOKENS_METRIC: count, LOGPROB_DIFF_METRIC: largest}


def agreement_metrics(batch, tq) -> dict[str, float]:
    """:func:`logprob_agreement` on the batch verl has just recomputed (its padded response tensors)."""
    from verl import DataProto

    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=list(AGREEMENT_FIELDS))
    padded = DataProto(batch=data.to_padded_tensor()).batch
    mask = padded["response_mask"][:, -padded["responses"].size(1):]
    return logprob_agreement(padded["old_log_probs"], padded["rollout_log_probs"], mask)


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


def filter_keep_mask(
    response_mask: torch.Tensor,
    entropies: torch.Tensor,
    token_scores: torch.Tensor,
    negative_token_fraction: float,
    failure_reward_threshold: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keep, failed)`` for a padded batch: keep [B, T] bool from :func:`entropy_filter`, failed [B]
    bool = (sum over the response of ``token_scores``) <= ``failure_reward_threshold``.

    Rows without response tokens (verl's synthetic padding) keep nothing.
    """
    mask = response_mask.bool()
    with torch.no_grad():
        sequence_rewards = torch.where(mask, token_scores, torch.zeros((), dtype=token_scores.dtype)).sum(dim=-1)
        failed = sequence_rewards <= failure_reward_threshold
        keep = entropy_filter(mask, entropies, failed, negative_token_fraction)
    return keep, failed


def write_entropy_filter_mask(batch, tq, negative_token_fraction: float, failure_reward_threshold: float, metrics=None):
    """Compute the filter's keep decisions for ``batch`` and store them as ``rollout_is_weights``.

    Returns the KVBatchMeta of the write (its ``fields`` include the new one), as verl's own steps do.
    """
    from tensordict import TensorDict
    from verl.workers.utils.padding import response_to_nested

    data = tq.kv_batch_get(
        keys=batch.keys, partition_id=batch.partition_id, select_fields=[*FILTER_INPUT_FIELDS, FILTER_MASK_FIELD]
    )
    if FILTER_MASK_FIELD in data.keys():
        raise ValueError(
            f"the batch already holds '{FILTER_MASK_FIELD}' (verl's rollout importance weights), the field that "
            "carries the entropy filter's mask to the FlashREINFORCE loss; refusing to overwrite them. "
            "Set algorithm.rollout_correction.rollout_is=null: the trust-region gate replaces importance weighting."
        )
    missing = [field for field in FILTER_INPUT_FIELDS if field not in data.keys()]
    if missing:
        raise ValueError(
            f"the entropy filter (true_on_policy.negative_token_fraction={negative_token_fraction}) needs the "
            f"batch fields {list(FILTER_INPUT_FIELDS)}; missing: {missing} (entropy comes from verl's log-prob "
            "recompute, which algorithm.rollout_correction.bypass_mode=true skips; rm_scores from the reward)"
        )
    response_mask = data["response_mask"]
    padded = data.select(*FILTER_INPUT_FIELDS).to_padded_tensor()
    keep, failed = filter_keep_mask(
        padded["response_mask"],
        padded["entropy"],
        padded["rm_scores"],
        negative_token_fraction,
        failure_reward_threshold,
    )
    if metrics is not None:
        trajectories = padded["response_mask"].bool().any(dim=-1)
        if bool(trajectories.any()):
            metrics[FAILED_FRACTION_METRIC] = failed[trajectories].float().mean().item()
    carrier = keep.to(torch.float32)
    fields = TensorDict({FILTER_MASK_FIELD: response_to_nested(carrier, response_mask)}, batch_size=len(batch.keys))
    return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)


def validate_flashreinforce_batch(batch, tq, negative_token_fraction: float) -> None:
    """What the FlashREINFORCE loss needs of the batch, checked once in the driver (host reads here,
    none in the per-micro-batch loss): a row with a response token; finite behaviour log-probs <= 0;
    one finite advantage per trajectory; with the filter on (q < 1), its 0/1 keep mask in the
    response, each row keeping all its T_i tokens or ceil(q * T_i). Raises ValueError naming what is wrong.
    """
    fields = ["response_mask", "old_log_probs", "advantages"] + ([FILTER_MASK_FIELD] if negative_token_fraction < 1.0 else [])
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    missing = [field for field in fields if field not in data.keys()]
    if missing:
        raise ValueError(f"the FlashREINFORCE batch lacks the fields {missing} (the trainer hooks write {FILTER_MASK_FIELD})")
    padded = data.select(*fields).to_padded_tensor()
    check_flashreinforce_batch(
        padded["response_mask"].bool(),
        padded["old_log_probs"],
        padded["advantages"],
        padded[FILTER_MASK_FIELD] if negative_token_fraction < 1.0 else None,
        negative_token_fraction,
    )


def check_flashreinforce_batch(mask, behaviour, advantages, carrier, negative_token_fraction: float) -> None:
    """:func:`validate_flashreinforce_batch` on padded tensors ([B, T]; ``carrier`` None when q = 1)."""
    if not bool(mask.any()):
        raise ValueError("flashreinforce: the batch has no row with a response token")
    bad = mask & ~(torch.isfinite(behaviour) & (behaviour <= 0))
    if bool(bad.any()):
        raise ValueError(
            "flashreinforce: the behaviour log-probs (old_log_probs = the rollout's rollout_log_probs) must be finite "
            f"and <= 0 at response tokens; first bad [row, position]: {torch.nonzero(bad)[:5].tolist()}"
        )
    first = advantages.gather(1, mask.to(torch.int32).argmax(dim=-1, keepdim=True))
    varies = mask & ((advantages != first) | ~torch.isfinite(advantages))
    if bool(varies.any()):
        rows = torch.nonzero(varies.any(dim=-1)).flatten()[:5].tolist()
        raise ValueError(
            f"loss_mode=flashreinforce needs one finite advantage per trajectory, but it varies (or is not finite) "
            f"within rows {rows}; use algorithm.adv_estimator=flashreinforce"
        )
    if carrier is not None:
        check_filter_mask(carrier, mask, negative_token_fraction)


def check_filter_mask(carrier: torch.Tensor, response_mask: torch.Tensor, fraction: float) -> None:
    """The entropy filter's carrier is its 0/1 keep mask: 0 outside the response, and each row keeps
    all its T_i response tokens (success) or ceil(q * T_i) of them (failure)."""
    ones, zeros = carrier == 1, carrier == 0
    if not bool((ones | zeros).all()):
        bad = torch.nonzero(~(ones | zeros))[:5].tolist()
        raise ValueError(
            f"'{FILTER_MASK_FIELD}' must be the entropy filter's 0/1 keep mask when negative_token_fraction < 1, "
            f"but holds other values (importance weights?) at [row, position] {bad}; "
            "rollout importance weighting is not supported: set algorithm.rollout_correction.rollout_is=null"
        )
    outside = ones & ~response_mask
    if bool(outside.any()):
        bad = torch.nonzero(outside)[:5].tolist()
        raise ValueError(f"the entropy filter mask keeps positions outside the response: [row, position] {bad}")
    for row, (count, total) in enumerate(zip(ones.sum(dim=-1).tolist(), response_mask.sum(dim=-1).tolist())):
        if count not in (total, kept_token_count(fraction, total)):
            raise ValueError(
                f"the entropy filter mask keeps {count} of the {total} response tokens of row {row}; with "
                f"negative_token_fraction={fraction} a row keeps all of them (success) or "
                f"{kept_token_count(fraction, total)} (failure)"
            )


def uses_flashreinforce_loss(trainer_config) -> bool:
    """The trainer's actor loss is FlashREINFORCE (its hooks run only then)."""
    return lookup(trainer_config, LOSS_MODE_KEY) == FLASHREINFORCE


def canonical_order(batch, tq) -> list[int]:
    """Indices that sort ``batch`` by token sequence (a stable sort: equal sequences keep their order)."""
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["input_ids"])
    sequences = [tuple(row.tolist()) for row in data["input_ids"].unbind()]
    return sorted(range(len(sequences)), key=sequences.__getitem__)


class ShortBatchError(RuntimeError):
    """The learner was handed fewer trajectories than the step sampled."""


def require_full_batch(batch, expected_prompts: int) -> None:
    """Raise :class:`ShortBatchError` unless ``batch`` holds trajectories of ``expected_prompts`` prompts.

    Keys are verl's ``{uid}_{session}_{index}``; padding rows (tag ``is_padding``) do not count.
    """
    prompts = {key.split("_", 1)[0] for key, tag in zip(batch.keys, batch.tags) if not tag.get("is_padding", False)}
    if len(prompts) < expected_prompts:
        raise ShortBatchError(
            f"the learner got trajectories of {len(prompts)} prompts, expected {expected_prompts} "
            f"(data.train_batch_size / parameter_sync_step): {expected_prompts - len(prompts)} rollout(s) failed "
            "(a dead or failing rollout server?). Refusing to train on a silently shorter batch. The async "
            "single-rollout sampler (configs/common/async_sampler.yaml, as in cpu_tiny_async) re-queues a failed "
            "prompt; verl 0.9.1's trainer.v1.sampler.sync_refill_failed_groups=true did not (the batch stayed short)."
        )


def install_on(trainer_cls, tq) -> None:
    """Wrap ``_balance_batch``, ``_compute_old_log_prob`` and ``_compute_advantage`` of ``trainer_cls``.

    Through :mod:`true_on_policy.verl_adapter.patches`, which checks verl's originals first. The
    wrappers read the settings the launch exported and refuse to run without them.
    """
    from true_on_policy.verl_adapter import patches

    def balance(balance_batch):
        def balance_canonical_batch(self, batch, *args, **kwargs):
            # verl 0.9.1 balances only the training batch, right after sampling it.
            require_full_batch(batch, self.config.data.train_batch_size // self.parameter_sync_step)
            if require("the canonical batch order").deterministic:
                batch.reorder(canonical_order(batch, tq))
            return balance_batch(self, batch, *args, **kwargs)

        return balance_canonical_batch

    def old_log_prob(recompute_old_log_prob):
        def compute_old_log_prob(self, batch, metrics):
            batch = recompute_old_log_prob(self, batch, metrics)
            if VERL_DIFF_METRIC in metrics:  # verl compared the recompute with the recorded log-probs
                metrics.update(agreement_metrics(batch, tq))
            if uses_flashreinforce_loss(self.config):
                use_rollout_log_probs_as_old(batch, tq)
            return batch

        return compute_old_log_prob

    def advantage(compute_advantage):
        def compute_advantage_and_filter_mask(self, batch, metrics):
            recipe = require("the entropy filter")
            batch = compute_advantage(self, batch, metrics)
            if uses_flashreinforce_loss(self.config):
                if recipe.negative_token_fraction < 1.0:
                    batch = write_entropy_filter_mask(
                        batch, tq, recipe.negative_token_fraction, recipe.failure_reward_threshold, metrics
                    )
                validate_flashreinforce_batch(batch, tq, recipe.negative_token_fraction)
            return batch

        return compute_advantage_and_filter_mask

    patches.wrap_trainer_method(trainer_cls, "_balance_batch", balance)
    patches.wrap_trainer_method(trainer_cls, "_compute_old_log_prob", old_log_prob)
    patches.wrap_trainer_method(trainer_cls, "_compute_advantage", advantage)


@functools.cache
def install() -> None:
    """:func:`install_on` verl's PPOTrainer when its module is imported: only the process that runs the trainer
    imports it (with transfer_queue and vLLM behind it, seconds of CPU), not every process the plugin loads in."""
    from true_on_policy.verl_adapter import patches

    def on_trainer_base(module) -> None:
        import transfer_queue as tq

        install_on(module.PPOTrainer, tq)

    patches.when_imported(patches.TRAINER_MODULE, on_trainer_base)
