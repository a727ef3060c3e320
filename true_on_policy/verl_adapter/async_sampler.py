"""The asynchronous single-rollout sampler: the learner takes the next B completed trajectories.

A ``ReplayBuffer`` subclass for verl's v1 async trainers (``trainer.v1.sampler.custom_sampler``):
each batch is the next B trajectories in TransferQueue's completion order (its controller lists
keys in creation order, and a key is created when a trajectory finishes), whichever prompts they
came from; nothing is replayed. A trajectory's policy lag is ``s - 1 - min_global_steps`` at
learner step ``s`` (its oldest sampling weights: the worst case for the importance ratio).
Exactly-once accounting per epoch is :class:`true_on_policy.rollout.prompt_ledger.PromptLedger`'s;
``sampler_kwargs`` and the ``flashreinforce/sampler/*`` metrics are listed in docs/async_sampler.md.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Mapping

import transfer_queue as tq
from tensordict.tensorclass import NonTensorData
from transfer_queue import KVBatchMeta

from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
from verl.utils import tensordict_utils as tu
from verl.utils.skip import SkipManager

from true_on_policy.verl_adapter import patches
from true_on_policy.rollout.prompt_ledger import (
    LAG_STRATEGIES,
    REQUEUE_FAILURE,
    REQUEUE_REASONS,
    PromptLedger,
    PromptLedgerError,
    SlotState,
    lag_histogram,
    policy_lag,
)
from true_on_policy.verl_adapter.sync_sampler import merge_sampler_kwargs

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

METRIC_PREFIX = "flashreinforce/sampler"
TRAIN = "train"
ASYNC_TRAINER_MODES = ("colocate_async", "separate_async")
SAMPLER_KWARGS_DEFAULTS = {
    "max_policy_lag": None,
    "lag_strategy": "drop",
    "poll_interval_s": 0.05,
    "rollout_timeout_s": None,
    "lag_histogram_buckets": 4,
    "max_rollout_failures": 3,
}


def parse_sampler_kwargs(sampler_kwargs: Mapping | None) -> dict:
    """Validated ``trainer.v1.sampler.sampler_kwargs``; an unknown key or a bad value is an error."""
    given = dict(sampler_kwargs or {})
    settings = merge_sampler_kwargs(given, SAMPLER_KWARGS_DEFAULTS, "the single-rollout sampler")
    lag = settings["max_policy_lag"]
    if lag is not None and (not isinstance(lag, int) or isinstance(lag, bool) or lag < 0):
        raise ValueError(f"sampler_kwargs.max_policy_lag must be an int >= 0 or null, got {lag!r}")
    if settings["lag_strategy"] not in LAG_STRATEGIES:
        raise ValueError(
            f"sampler_kwargs.lag_strategy must be one of {LAG_STRATEGIES}, got {settings['lag_strategy']!r}"
        )
    if lag is None and given.get("lag_strategy") is not None:
        raise ValueError("sampler_kwargs.lag_strategy is set but max_policy_lag is null: there is no bound to enforce")
    timeout = settings["rollout_timeout_s"]
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"sampler_kwargs.rollout_timeout_s must be a number > 0 or null, got {timeout!r}")
    failures = settings["max_rollout_failures"]
    if not isinstance(failures, int) or isinstance(failures, bool) or failures < 1:
        raise ValueError(f"sampler_kwargs.max_rollout_failures must be an int >= 1, got {failures!r}")
    buckets = settings["lag_histogram_buckets"]
    if not isinstance(buckets, int) or isinstance(buckets, bool) or buckets < 2:
        raise ValueError(f"sampler_kwargs.lag_histogram_buckets must be an int >= 2, got {buckets!r}")
    return settings


class RolloutFailuresError(RuntimeError):
    """A prompt's rollout failed ``max_rollout_failures`` times: the rollout side is broken, stop."""


class _Listing:
    """One TransferQueue listing of the train partition, split into prompt markers and trajectories."""

    def __init__(self, items: Mapping[str, Mapping]):
        self.prompts: dict[str, Mapping] = {}  # uid -> tag, in dispatch order
        self.trajectories: dict[str, list[tuple[str, Mapping]]] = defaultdict(list)  # uid -> [(key, tag)]
        self.completion_order: list[str] = []  # uids, by the creation of their first trajectory key
        for key, tag in items.items():
            if tag.get("is_prompt", False):
                self.prompts[key] = tag
                continue
            uid = key.split("_", 1)[0]
            if uid not in self.trajectories:
                self.completion_order.append(uid)
            self.trajectories[uid].append((key, tag))

    @classmethod
    def read(cls) -> _Listing:
        listing = tq.kv_list(TRAIN) or {}
        return cls(listing.get(TRAIN, {}))


class SingleRolloutAsyncSampler(ReplayBufferAsync):
    """verl ``ReplayBuffer`` for FlashREINFORCE's one-pass asynchronous update (see the module doc)."""

    def __init__(
        self,
        trainer_mode: str,
        trainer_config,
        max_off_policy_threshold: int | None,
        max_off_policy_strategy: str,
        sampler_kwargs,
        poll_interval: float = 2.0,
        refill_fn=None,
    ):
        if trainer_mode not in ASYNC_TRAINER_MODES:
            raise ValueError(
                f"{type(self).__name__} needs an async v1 trainer (trainer.v1.trainer_mode in {ASYNC_TRAINER_MODES}), "
                f"got {trainer_mode!r}: only they keep each prompt's data in TransferQueue for a re-queue, and the "
                "sync trainer discards what a batch does not take"
            )
        if max_off_policy_threshold is not None:
            raise ValueError(
                f"trainer.v1.sampler.max_off_policy_threshold={max_off_policy_threshold}: {type(self).__name__} bounds "
                "staleness itself, by the behaviour versions the rollout recorded, through "
                "trainer.v1.sampler.sampler_kwargs.max_policy_lag; set max_off_policy_threshold=null"
            )
        if refill_fn is None or getattr(refill_fn, "__self__", None) is None:
            raise ValueError(
                f"{type(self).__name__} re-dispatches prompts through the trainer's agent loop, which it reaches via "
                "refill_fn (the trainer's bound _add_prompts_to_generate); got refill_fn={refill_fn!r}"
            )
        self.settings = parse_sampler_kwargs(sampler_kwargs)
        super().__init__(
            trainer_mode=trainer_mode,
            trainer_config=trainer_config,
            # verl's own staleness eviction stays off; validation sampling (inherited) ignores it anyway.
            max_off_policy_threshold=None,
            max_off_policy_strategy="drop",
            sampler_kwargs=sampler_kwargs,
            poll_interval=self.settings["poll_interval_s"],
            refill_fn=refill_fn,
        )
        self.max_policy_lag: int | None = self.settings["max_policy_lag"]
        self.lag_strategy: str = self.settings["lag_strategy"]
        self.rollout_timeout_s: float | None = self.settings["rollout_timeout_s"]
        self.lag_histogram_buckets: int = self.settings["lag_histogram_buckets"]
        # The trainer instance: its agent loop re-dispatches prompts, its dataset sizes an epoch.
        self._trainer = patches.trainer_behind_refill_fn(refill_fn)
        self.ledger: PromptLedger | None = None
        self._clear_delivered_leftovers = False
        self._listing = _Listing({})
        self._requeues_reported: Counter = Counter()
        self._late_reported = 0
        # The prefetch window: prompts dispatched ahead of the learner. Under FIFO-like completion a
        # prompt reaches the learner about num_warmup_batches steps after dispatch, so a tighter lag
        # bound re-rolls part of every batch, whichever strategy.
        prefetch_batches = float((trainer_config or {}).get("num_warmup_batches", 0) or 0)
        if self.max_policy_lag is not None and self.max_policy_lag < math.ceil(prefetch_batches):
            logger.warning(
                "max_policy_lag=%d < num_warmup_batches=%s: the trainer keeps more prompts in flight than the "
                "lag bound lets the learner take in time; expect part of each batch to be re-rolled "
                "(flashreinforce/sampler/requeued/policy_lag). Lower num_warmup_batches or raise max_policy_lag.",
                self.max_policy_lag,
                prefetch_batches,
            )

    # ------------------------------------------------------------------ verl's ReplayBuffer API
    @SkipManager.annotate_tq(role="rollout_tq", phase="sample")
    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[KVBatchMeta, dict]:
        if partition_id != TRAIN:
            # Validation is a synchronous pass over the val set: verl's own logic. Its undecorated body,
            # since this method already carries the skip decorator.
            return ReplayBufferAsync.sample.__wrapped__(self, global_steps, partition_id, batch_size)
        started = time.monotonic()
        lag_wait_s = 0.0
        while True:
            poll_started = time.monotonic()
            self._refresh(global_steps)
            decision = self.ledger.take_batch(batch_size, global_steps, self.max_policy_lag, self.lag_strategy)
            if decision.dropped_for_lag:
                if self.lag_strategy == "wait":
                    # wait never lets a trajectory age past the bound unless more of them reached it
                    # than one batch can take: the prefetch window is too deep for the bound.
                    logger.warning(
                        "step %d: %d trajectories at max_policy_lag=%d did not fit in the batch; re-queuing them",
                        global_steps,
                        len(decision.dropped_for_lag),
                        self.max_policy_lag,
                    )
                else:
                    logger.info(
                        "step %d: dropping %d trajectories beyond max_policy_lag=%d; re-queuing their prompts",
                        global_steps,
                        len(decision.dropped_for_lag),
                        self.max_policy_lag,
                    )
                self._requeue(global_steps)
            if decision.ready:
                break
            time.sleep(self.settings["poll_interval_s"])
            if decision.waiting_for == "lag_bound":
                lag_wait_s += time.monotonic() - poll_started
        fill_seconds = time.monotonic() - started
        batch = self._materialize(decision.delivered)
        self.ledger.check_invariants()
        return batch, self._step_metrics(global_steps, decision.delivered, fill_seconds, lag_wait_s)

    def get_sampleable_count(self, global_steps: int, partition_id: str) -> int:
        if partition_id != TRAIN:
            return super().get_sampleable_count(global_steps, partition_id)
        self._refresh(global_steps)
        return self.ledger.count(SlotState.COMPLETED)

    def wait_for_sampleable(self, global_steps: int, partition_id: str, target_count: int) -> tuple[set[str], dict]:
        if partition_id != TRAIN:
            return super().wait_for_sampleable(global_steps, partition_id, target_count)
        while True:
            self._refresh(global_steps)
            completed = {slot.attempt_id for slot in self.ledger.slots() if slot.state is SlotState.COMPLETED}
            if len(completed) >= target_count:
                return completed, {}
            time.sleep(self.settings["poll_interval_s"])

    # ------------------------------------------------------------------ checkpoint (verl_adapter.resume)
    STATE_VERSION = 1

    def state_dict(self) -> dict:
        """What a resume needs beyond verl's TransferQueue checkpoint: the ledger and the metric baselines."""
        return {
            "version": self.STATE_VERSION,
            "ledger": None if self.ledger is None else pickle.dumps(self.ledger),
            "requeues_reported": dict(self._requeues_reported),
            "late_reported": self._late_reported,
        }

    def load_state_dict(self, state: Mapping) -> None:
        if state.get("version") != self.STATE_VERSION:
            raise ValueError(
                f"sampler checkpoint state version {state.get('version')!r} != {self.STATE_VERSION} "
                f"({type(self).__name__}); it was written by another version of true_on_policy"
            )
        ledger = None if state["ledger"] is None else pickle.loads(state["ledger"])
        if ledger is not None:
            # Attempt clocks are the old process's monotonic time: restart them (a timeout counts anew).
            ledger.restart_clocks(time.monotonic())
        self.ledger = ledger
        # verl saves the checkpoint before it clears the step's batch, so the restored TransferQueue
        # still holds the trajectories of the last delivered batch: cleared at the first listing.
        self._clear_delivered_leftovers = ledger is not None
        self._requeues_reported = Counter(state["requeues_reported"])
        self._late_reported = state["late_reported"]

    # ------------------------------------------------------------------ observing the rollout
    def _ensure_ledger(self, global_steps: int) -> PromptLedger:
        if self.ledger is None:
            trainer = self._trainer
            for attribute in ("agent_loop_manager", "train_dataset"):
                if not hasattr(trainer, attribute):
                    raise RuntimeError(
                        f"{type(self).__name__}: the trainer behind refill_fn has no {attribute!r}; "
                        "sample() must be called from verl's v1 trainer after fit() started"
                    )
            # A fresh run starts at an epoch boundary. A resumed one gets its ledger from the checkpoint
            # (load_state_dict); one without (a checkpoint taken before the first sample) may not start
            # at a boundary, and then per-epoch duplicate detection would misfire, so the ledger numbers
            # each prompt's occurrences instead.
            fresh_run = global_steps == 1
            prompts_per_epoch = len(trainer.train_dataset) if fresh_run else None
            if not fresh_run:
                logger.warning(
                    "%s: resumed at step %d; epoch boundaries of the restored data stream are unknown, so the "
                    "prompt ledger counts occurrences per prompt and cannot flag a duplicate within an epoch",
                    type(self).__name__,
                    global_steps,
                )
            self.ledger = PromptLedger(prompts_per_epoch=prompts_per_epoch)
        return self.ledger

    def _refresh(self, global_steps: int) -> None:
        """Read TransferQueue once; feed dispatches, completions and failures to the ledger; re-queue."""
        ledger = self._ensure_ledger(global_steps)
        now = time.monotonic()
        listing = _Listing.read()
        self._listing = listing
        if self._clear_delivered_leftovers:
            self._clear_delivered_leftovers = False
            delivered = {slot.attempt_id for slot in ledger.slots() if slot.state is SlotState.DELIVERED}
            leftovers = [
                key
                for uid, trajectories in listing.trajectories.items()
                if uid in delivered and uid not in listing.prompts
                for key, _ in trajectories
            ]
            if leftovers:
                tq.kv_clear(partition_id=TRAIN, keys=leftovers)
                listing = _Listing({k: v for k, v in (tq.kv_list(TRAIN) or {}).get(TRAIN, {}).items()})
                self._listing = listing

        fresh = [uid for uid in listing.prompts if not ledger.knows(uid)]
        if fresh:
            for uid, prompt_id in zip(fresh, self._prompt_ids(fresh), strict=True):
                ledger.dispatched(uid, prompt_id, int(listing.prompts[uid]["global_steps"]), now)

        finished_keys_to_clear: list[str] = []
        # Completions are fed in completion order so the ledger's sequence is TransferQueue's.
        ordered = listing.completion_order + [uid for uid in listing.prompts if uid not in listing.trajectories]
        for uid in ordered:
            tag = listing.prompts.get(uid)
            if tag is None:
                continue  # trajectories of a delivered batch, awaiting the trainer's cleanup
            status = tag.get("status")
            if status not in ("finished", "failure"):
                continue
            if ledger.is_superseded(uid):
                # The replaced attempt reached a terminal status: it cannot write again, drop its keys.
                if status == "finished" and listing.trajectories.get(uid):
                    ledger.late_result_discarded(uid)
                finished_keys_to_clear.extend([uid, *(key for key, _ in listing.trajectories.get(uid, []))])
                ledger.forget_superseded(uid)
                continue
            if status == "failure":
                if ledger.failed(uid, REQUEUE_FAILURE) == "requeue":
                    self._check_failures(uid, "failed")
                    logger.warning("rollout of prompt uid=%s failed; re-queuing the prompt", uid)
                continue
            trajectories = listing.trajectories.get(uid)
            if not trajectories:
                # verl's agent loop logs "Empty output" and writes nothing: no trajectory to train on.
                if ledger.failed(uid, REQUEUE_FAILURE) == "requeue":
                    self._check_failures(uid, "finished without a trajectory")
                    logger.warning("prompt uid=%s finished without a trajectory; re-queuing the prompt", uid)
                continue
            min_version, max_version = _behaviour_versions(uid, trajectories)
            ledger.completed(uid, min_version, max_version)
        if finished_keys_to_clear:
            tq.kv_clear(partition_id=TRAIN, keys=finished_keys_to_clear)

        if self.rollout_timeout_s is not None:
            for slot in ledger.time_out(now, self.rollout_timeout_s):
                logger.warning(
                    "rollout of prompt uid=%s in flight for more than %.1fs; re-queuing the prompt",
                    slot.attempt_id,
                    self.rollout_timeout_s,
                )
        self._requeue(global_steps)

    def _check_failures(self, uid: str, what: str) -> None:
        slot = self.ledger.live_slot(uid)
        failures = slot.requeue_reasons.count(REQUEUE_FAILURE)
        if failures >= self.settings["max_rollout_failures"]:
            raise RolloutFailuresError(
                f"the rollout of prompt {slot.prompt_id!r} (epoch {slot.epoch}) {what} {failures} times "
                f"(trainer.v1.sampler.sampler_kwargs.max_rollout_failures={self.settings['max_rollout_failures']}): "
                "the rollout side is failing every request (a dead rollout server?); stopping instead of "
                "re-queuing forever. The last checkpoint is intact: fix the rollout and resume from it."
            )

    def _prompt_ids(self, uids: list[str]) -> list:
        """Dataset identity of each prompt: the ``index`` column RLHFDataset takes from extra_info.index."""
        data = tq.kv_batch_get(keys=uids, partition_id=TRAIN, select_fields=["index"])
        if "index" not in data.keys():
            raise RuntimeError(
                "prompt data in TransferQueue has no 'index' field; the single-rollout sampler identifies prompts "
                "by the dataset's extra_info.index"
            )
        return [_plain(value) for value in data["index"]]

    def _requeue(self, global_steps: int) -> None:
        """Roll every prompt awaiting re-queue out again, from the prompt data verl keeps in TransferQueue."""
        slots = self.ledger.awaiting_requeue()
        if not slots:
            return
        old_uids = [slot.attempt_id for slot in slots]
        prompts = tq.kv_batch_get(keys=old_uids, partition_id=TRAIN)
        # A fresh uid per attempt: whatever the replaced attempt still writes lands under its own keys.
        new_uids = [str(uuid.uuid4()) for _ in slots]
        tu.assign_non_tensor_stack(prompts, "uid", new_uids)
        tu.assign_non_tensor_data(prompts, "global_steps", global_steps)
        tq.kv_batch_put(
            keys=new_uids,
            partition_id=TRAIN,
            tags=[{"is_prompt": True, "status": "pending", "global_steps": global_steps} for _ in new_uids],
            # Persisted like verl's own async dispatch, so a later re-queue or a checkpoint finds it.
            fields=prompts.select(*[key for key in prompts.keys() if not isinstance(prompts.get(key), NonTensorData)]),
        )
        now = time.monotonic()
        terminal_keys: list[str] = []
        for slot, old_uid, new_uid in zip(slots, old_uids, new_uids, strict=True):
            self.ledger.requeued(old_uid, new_uid, global_steps, now)
            old_tag = self._listing.prompts.get(old_uid, {})
            if old_tag.get("status") in ("finished", "failure"):
                # Settled: nothing will write under the old uid again.
                terminal_keys.extend([old_uid, *(key for key, _ in self._listing.trajectories.get(old_uid, []))])
                self.ledger.forget_superseded(old_uid)
        if terminal_keys:
            tq.kv_clear(partition_id=TRAIN, keys=terminal_keys)
        self._trainer.agent_loop_manager.generate_sequences(prompts)
        logger.info(
            "re-queued %d prompt(s) at step %d (re-queues so far: %s)",
            len(slots),
            global_steps,
            dict(self.ledger.requeues),
        )

    # ------------------------------------------------------------------ handing the batch to the learner
    def _materialize(self, delivered) -> KVBatchMeta:
        keys, tags = [], []
        for slot in delivered:
            trajectories = self._listing.trajectories.get(slot.attempt_id)
            if not trajectories:
                raise PromptLedgerError(
                    f"prompt uid={slot.attempt_id} was delivered but its trajectory is no longer in TransferQueue"
                )
            for key, tag in trajectories:
                keys.append(key)
                tags.append(dict(tag))
        # The prompt markers go now; the trainer clears the trajectories after the step (nothing is replayed).
        tq.kv_clear(partition_id=TRAIN, keys=[slot.attempt_id for slot in delivered])
        return KVBatchMeta(partition_id=TRAIN, keys=keys, tags=tags)

    def _step_metrics(self, global_steps: int, delivered, fill_seconds: float, lag_wait_s: float) -> dict:
        prefix = METRIC_PREFIX
        lags = [policy_lag(global_steps, slot.min_version) for slot in delivered]
        newest_lags = [policy_lag(global_steps, slot.max_version) for slot in delivered]
        metrics = {
            f"{prefix}/policy_lag/mean": sum(lags) / len(lags),
            f"{prefix}/policy_lag/max": max(lags),
            f"{prefix}/policy_lag/min": min(lags),
            f"{prefix}/policy_lag_newest/mean": sum(newest_lags) / len(newest_lags),
            f"{prefix}/version_span/max": max(slot.max_version - slot.min_version + 1 for slot in delivered),
            f"{prefix}/fill_seconds": fill_seconds,
            f"{prefix}/lag_wait_seconds": lag_wait_s,
            f"{prefix}/distinct_prompts": len({slot.prompt_id for slot in delivered}),
            f"{prefix}/in_flight": self.ledger.count(SlotState.IN_FLIGHT),
            f"{prefix}/completed_waiting": self.ledger.count(SlotState.COMPLETED),
        }
        for bucket, count in lag_histogram(lags, self.lag_histogram_buckets).items():
            metrics[f"{prefix}/policy_lag_hist/{bucket}"] = count
        for reason in REQUEUE_REASONS:
            metrics[f"{prefix}/requeued/{reason}"] = self.ledger.requeues[reason] - self._requeues_reported[reason]
        self._requeues_reported = Counter(self.ledger.requeues)
        metrics[f"{prefix}/late_results_discarded"] = self.ledger.late_results - self._late_reported
        self._late_reported = self.ledger.late_results
        latest_epoch = max(slot.epoch for slot in delivered)
        metrics[f"{prefix}/epoch"] = latest_epoch
        metrics[f"{prefix}/epoch_delivered"] = self.ledger.epoch_summary(latest_epoch).delivered
        return metrics


def _behaviour_versions(uid: str, trajectories: list[tuple[str, Mapping]]) -> tuple[int, int]:
    """(oldest, newest) policy version over a prompt's trajectory keys, from the rollout's tags."""
    mins, maxes = [], []
    for key, tag in trajectories:
        low, high = tag.get("min_global_steps"), tag.get("max_global_steps")
        if low is None or high is None:
            raise PromptLedgerError(
                f"trajectory {key} has no behaviour-version tags (min_global_steps={low!r}, "
                f"max_global_steps={high!r}): the rollout server must report extra_fields['global_steps'] "
                "(set by update_weights) so the policy lag can be measured"
            )
        mins.append(int(low))
        maxes.append(int(high))
    return min(mins), max(maxes)


def _plain(value):
    """A TransferQueue/numpy scalar as a plain Python value (prompt ids are compared and hashed)."""
    value = getattr(value, "data", value)
    item = getattr(value, "item", None)
    if callable(item):
        value = item()
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


__all__ = ["METRIC_PREFIX", "SAMPLER_KWARGS_DEFAULTS", "RolloutFailuresError", "SingleRolloutAsyncSampler", "parse_sampler_kwargs"]
