"""Prompt accounting for the asynchronous single-rollout sampler (FlashREINFORCE, one rollout per prompt).

The learner takes the next B completed trajectories in completion order, whichever prompts they came
from, steps once and discards them. With one rollout per prompt the accounting unit is the prompt's
*occurrence* in an epoch: the dataloader yields every prompt once per epoch, and that occurrence must
reach the learner at most once, never be lost, and be rolled out again when an attempt fails, is
aborted, times out or is dropped for exceeding the policy-lag bound.

:class:`PromptLedger` is that state machine. Each occurrence (a :class:`PromptSlot`) has exactly one
live attempt (one rollout request, named by the key the rollout writes under); a re-queue replaces
the attempt, and anything the superseded attempt still reports is a *late result*, discarded and
counted, never delivered. The ledger also owns the batch policy, because the policy is what the
accounting must guarantee: completion order, the lag bound (``drop`` or ``wait``) and delivery.

Pure: no verl, Ray or torch import. Time is passed in by the caller, so tests can drive it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence

LAG_STRATEGIES = ("drop", "wait")

# Why a prompt was rolled out again. A rollout that the server aborted and did not resume surfaces
# as a failed rollout; a timeout is the sampler giving up on an attempt it can still hear from later.
REQUEUE_FAILURE = "rollout_failure"
REQUEUE_TIMEOUT = "timeout"
REQUEUE_POLICY_LAG = "policy_lag"
REQUEUE_REASONS = (REQUEUE_FAILURE, REQUEUE_TIMEOUT, REQUEUE_POLICY_LAG)


class PromptLedgerError(RuntimeError):
    """The accounting would lose or duplicate a prompt, or was fed an impossible event."""


class SlotState(enum.Enum):
    IN_FLIGHT = "in_flight"  # the live attempt is queued or generating
    COMPLETED = "completed"  # the live attempt finished; waiting for the learner
    AWAITING_REQUEUE = "awaiting_requeue"  # must be rolled out again; the caller re-dispatches it
    DELIVERED = "delivered"  # taken by the learner: terminal


@dataclasses.dataclass
class PromptSlot:
    """One occurrence of a prompt in an epoch and the state of its live attempt."""

    epoch: int
    prompt_id: Hashable
    attempt_id: str
    dispatch_step: int  # learner step at which the live attempt was dispatched
    dispatched_at: float  # caller's clock when the live attempt was first seen in flight
    state: SlotState = SlotState.IN_FLIGHT
    attempts: int = 1
    requeue_reasons: list[str] = dataclasses.field(default_factory=list)
    completion_seq: int | None = None
    min_version: int | None = None  # oldest policy version that sampled a token of the live attempt
    max_version: int | None = None  # newest policy version that sampled a token of the live attempt
    delivered_at_step: int | None = None


def policy_lag(learner_step: int, behaviour_version: int) -> int:
    """How many optimizer steps the learner's current weights are ahead of ``behaviour_version``.

    At learner step ``s`` the weights being differentiated are version ``s - 1`` (the rollout is
    updated to version ``s`` after step ``s``), so a trajectory sampled by version ``v`` lags by
    ``s - 1 - v``; 0 is on-policy.
    """
    return learner_step - 1 - behaviour_version


@dataclasses.dataclass(frozen=True)
class BatchDecision:
    """What :meth:`PromptLedger.take_batch` decided on one look at the ledger."""

    delivered: tuple[PromptSlot, ...]  # empty unless the batch is full
    dropped_for_lag: tuple[PromptSlot, ...]  # completed beyond the lag bound, now awaiting re-queue
    waiting_for: str | None  # None when delivered; else "batch_not_full" or "lag_bound"
    blocking_in_flight: int = 0  # wait strategy: in-flight attempts that must finish first

    @property
    def ready(self) -> bool:
        return self.waiting_for is None


@dataclasses.dataclass(frozen=True)
class EpochSummary:
    epoch: int
    dispatched: int
    delivered: int
    in_flight: int
    completed_waiting: int
    awaiting_requeue: int
    requeues: dict[str, int]
    late_results: int


class PromptLedger:
    """Exactly-once-per-epoch delivery of single-rollout prompts to the learner.

    Args:
        prompts_per_epoch: how many prompts the dataloader yields per epoch. When given, the k-th
            fresh dispatch belongs to epoch ``k // prompts_per_epoch`` and a prompt id seen twice in
            one epoch is an error (ids are not unique, or prompts came from outside the dataloader).
            ``None`` (e.g. after a resume mid-epoch, where the boundary is unknown) numbers each
            prompt id's occurrences instead and cannot detect such duplicates.
    """

    def __init__(self, prompts_per_epoch: int | None):
        if prompts_per_epoch is not None and (
            not isinstance(prompts_per_epoch, int) or isinstance(prompts_per_epoch, bool) or prompts_per_epoch <= 0
        ):
            raise ValueError(f"prompts_per_epoch must be a positive int or None, got {prompts_per_epoch!r}")
        self.prompts_per_epoch = prompts_per_epoch
        self._slots: list[PromptSlot] = []
        self._live: dict[str, PromptSlot] = {}  # live attempt id -> slot
        self._superseded: dict[str, PromptSlot] = {}  # replaced attempt id -> its slot
        self._attempt_ids: set[str] = set()  # every attempt id ever used, delivered ones included
        self._occurrences: Counter = Counter()  # prompt id -> fresh dispatches so far
        self._epoch_prompts: dict[int, set] = {}
        self._fresh_dispatches = 0
        self._next_completion_seq = 0
        self.requeues: Counter = Counter()  # reason -> count
        self._epoch_requeues: dict[int, Counter] = {}
        self.late_results = 0
        self._epoch_late: Counter = Counter()
        # (epoch, prompt_id, learner_step, attempt_id) per trajectory handed to the learner, in order.
        self.delivery_log: list[tuple[int, Hashable, int, str]] = []

    # ------------------------------------------------------------------ events from the rollout side
    def knows(self, attempt_id: str) -> bool:
        return attempt_id in self._live or attempt_id in self._superseded

    def is_superseded(self, attempt_id: str) -> bool:
        return attempt_id in self._superseded

    def dispatched(self, attempt_id: str, prompt_id: Hashable, dispatch_step: int, now: float) -> PromptSlot:
        """A prompt fresh from the dataloader entered rollout as ``attempt_id``."""
        self._require_new_attempt_id(attempt_id)
        _require_int("dispatch_step", dispatch_step)
        occurrences = self._occurrences[prompt_id]
        if self.prompts_per_epoch is None:
            epoch = occurrences
        else:
            epoch = self._fresh_dispatches // self.prompts_per_epoch
            if occurrences != epoch:
                raise PromptLedgerError(
                    f"prompt {prompt_id!r} is dispatched for the {occurrences + 1}th time in epoch {epoch} "
                    f"({self.prompts_per_epoch} prompts per epoch): the dataloader yields each prompt once per "
                    "epoch, so prompt ids are not unique (check the dataset's extra_info.index) or prompts "
                    "were dispatched from outside the dataloader"
                )
        slot = PromptSlot(
            epoch=epoch, prompt_id=prompt_id, attempt_id=attempt_id, dispatch_step=dispatch_step, dispatched_at=now
        )
        self._occurrences[prompt_id] += 1
        self._fresh_dispatches += 1
        self._epoch_prompts.setdefault(epoch, set()).add(prompt_id)
        self._slots.append(slot)
        self._live[attempt_id] = slot
        self._attempt_ids.add(attempt_id)
        return slot

    def completed(self, attempt_id: str, min_version: int, max_version: int) -> str:
        """The attempt's trajectory is complete. Call in completion order; repeats are ignored.

        Returns ``"accepted"`` (queued for the learner, next in completion order), ``"known"``
        (already recorded) or ``"late"`` (a superseded attempt: discard its result).
        """
        if attempt_id in self._superseded:
            return "late"
        slot = self._slot_of_live(attempt_id)
        if slot.state in (SlotState.COMPLETED, SlotState.DELIVERED):
            return "known"
        if slot.state is SlotState.AWAITING_REQUEUE:
            # Already condemned (failure reported first, or timed out); the re-dispatch supersedes it.
            return "known"
        _require_int("min_version", min_version)
        _require_int("max_version", max_version)
        if min_version > max_version:
            raise PromptLedgerError(
                f"attempt {attempt_id}: min_version {min_version} > max_version {max_version}; the rollout's "
                "behaviour-version tags are inconsistent"
            )
        slot.state = SlotState.COMPLETED
        slot.min_version, slot.max_version = min_version, max_version
        slot.completion_seq = self._next_completion_seq
        self._next_completion_seq += 1
        return "accepted"

    def failed(self, attempt_id: str, reason: str = REQUEUE_FAILURE) -> str:
        """The attempt failed or was aborted for good; its prompt awaits re-queue.

        Returns ``"requeue"``, ``"known"`` (already awaiting re-queue) or ``"late"`` (superseded).
        """
        _require_reason(reason)
        if attempt_id in self._superseded:
            return "late"
        slot = self._slot_of_live(attempt_id)
        if slot.state is SlotState.DELIVERED:
            raise PromptLedgerError(
                f"attempt {attempt_id} reported failure after its trajectory reached the learner; "
                "a delivered prompt cannot be rolled out again"
            )
        if slot.state is SlotState.AWAITING_REQUEUE:
            return "known"
        self._condemn(slot, reason)
        return "requeue"

    def time_out(self, now: float, timeout_s: float) -> list[PromptSlot]:
        """Condemn in-flight attempts first seen more than ``timeout_s`` ago; they await re-queue.

        The timed-out attempt may still finish later; its result is then a late result.
        """
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        expired = [
            slot
            for slot in self._live.values()
            if slot.state is SlotState.IN_FLIGHT and now - slot.dispatched_at > timeout_s
        ]
        for slot in expired:
            self._condemn(slot, REQUEUE_TIMEOUT)
        return expired

    def awaiting_requeue(self) -> list[PromptSlot]:
        """Slots the caller must roll out again (then report with :meth:`requeued`), oldest first."""
        return [slot for slot in self._live.values() if slot.state is SlotState.AWAITING_REQUEUE]

    def requeued(self, old_attempt_id: str, new_attempt_id: str, dispatch_step: int, now: float) -> PromptSlot:
        """The caller rolled the slot of ``old_attempt_id`` out again as ``new_attempt_id``."""
        slot = self._slot_of_live(old_attempt_id)
        if slot.state is not SlotState.AWAITING_REQUEUE:
            raise PromptLedgerError(
                f"attempt {old_attempt_id} is {slot.state.value}, not awaiting re-queue: re-dispatching it would "
                "roll the prompt out twice"
            )
        self._require_new_attempt_id(new_attempt_id)
        _require_int("dispatch_step", dispatch_step)
        self._attempt_ids.add(new_attempt_id)
        del self._live[old_attempt_id]
        self._superseded[old_attempt_id] = slot
        slot.attempt_id = new_attempt_id
        slot.dispatch_step = dispatch_step
        slot.dispatched_at = now
        slot.state = SlotState.IN_FLIGHT
        slot.attempts += 1
        slot.completion_seq = slot.min_version = slot.max_version = None
        self._live[new_attempt_id] = slot
        return slot

    def late_result_discarded(self, attempt_id: str) -> None:
        """Count a superseded attempt's result that the caller threw away."""
        slot = self._superseded.get(attempt_id)
        if slot is None:
            raise PromptLedgerError(f"attempt {attempt_id} is not superseded; its result is not late")
        self.late_results += 1
        self._epoch_late[slot.epoch] += 1

    def forget_superseded(self, attempt_id: str) -> None:
        """The superseded attempt's keys are gone for good; stop recognising it."""
        self._superseded.pop(attempt_id, None)

    # ------------------------------------------------------------------ the learner side
    def take_batch(
        self,
        batch_size: int,
        learner_step: int,
        max_policy_lag: int | None = None,
        lag_strategy: str = "drop",
    ) -> BatchDecision:
        """Deliver the next ``batch_size`` completed trajectories in completion order, if there are enough.

        Completed trajectories whose policy lag exceeds ``max_policy_lag`` are never delivered: they
        move to awaiting re-queue (both strategies; under ``wait`` this only happens when more
        trajectories reached the bound than one batch can take). Under ``wait`` the learner also
        holds off while an in-flight attempt could exceed the bound by the next step (its lag is
        bounded by ``learner_step - dispatch_step``), so it finishes first; and completed
        trajectories that would exceed the bound at the next step go first.
        """
        _require_positive_int("batch_size", batch_size)
        _require_int("learner_step", learner_step)
        if max_policy_lag is not None:
            _require_int("max_policy_lag", max_policy_lag)
            if max_policy_lag < 0:
                raise ValueError(f"max_policy_lag must be >= 0 or None, got {max_policy_lag}")
        if lag_strategy not in LAG_STRATEGIES:
            raise ValueError(f"lag_strategy must be one of {LAG_STRATEGIES}, got {lag_strategy!r}")

        completed = sorted(
            (slot for slot in self._live.values() if slot.state is SlotState.COMPLETED),
            key=lambda slot: slot.completion_seq,
        )
        for slot in completed:
            lag = policy_lag(learner_step, slot.min_version)
            if lag < 0:
                raise PromptLedgerError(
                    f"attempt {slot.attempt_id} was sampled by policy version {slot.min_version}, newer than the "
                    f"learner's weights at step {learner_step} (version {learner_step - 1}): version tags and "
                    "learner steps disagree"
                )
        dropped: list[PromptSlot] = []
        if max_policy_lag is not None:
            for slot in completed:
                if policy_lag(learner_step, slot.min_version) > max_policy_lag:
                    self._condemn(slot, REQUEUE_POLICY_LAG)
                    dropped.append(slot)
            completed = [slot for slot in completed if slot.state is SlotState.COMPLETED]

        if max_policy_lag is not None and lag_strategy == "wait":
            # An attempt dispatched at step d was first sampled by version >= d - 1, so at the next
            # step its lag is at most learner_step - d + 1. Re-queues go out at this step.
            blocking = sum(
                1
                for slot in self._live.values()
                if (
                    (slot.state is SlotState.IN_FLIGHT and learner_step - slot.dispatch_step + 1 > max_policy_lag)
                    or (slot.state is SlotState.AWAITING_REQUEUE and 1 > max_policy_lag)
                )
            )
            if blocking:
                return BatchDecision((), tuple(dropped), "lag_bound", blocking_in_flight=blocking)
            # At the bound now means beyond it at the next step: these go first.
            completed.sort(
                key=lambda slot: (policy_lag(learner_step + 1, slot.min_version) <= max_policy_lag, slot.completion_seq)
            )

        if len(completed) < batch_size:
            return BatchDecision((), tuple(dropped), "batch_not_full")
        batch = completed[:batch_size]
        for slot in batch:
            slot.state = SlotState.DELIVERED
            slot.delivered_at_step = learner_step
            del self._live[slot.attempt_id]
            self.delivery_log.append((slot.epoch, slot.prompt_id, learner_step, slot.attempt_id))
        return BatchDecision(tuple(batch), tuple(dropped), None)

    def restart_clocks(self, now: float) -> None:
        """After a restore in another process: every live attempt counts its time in flight from ``now``."""
        for slot in self._live.values():
            slot.dispatched_at = now

    # ------------------------------------------------------------------ accounting
    def slots(self) -> Sequence[PromptSlot]:
        return tuple(self._slots)

    def live_slot(self, attempt_id: str) -> PromptSlot | None:
        return self._live.get(attempt_id)

    def count(self, state: SlotState) -> int:
        return sum(1 for slot in self._live.values() if slot.state is state)

    @property
    def delivered_total(self) -> int:
        return len(self._slots) - len(self._live)

    def epoch_summary(self, epoch: int) -> EpochSummary:
        slots = [slot for slot in self._slots if slot.epoch == epoch]
        by_state = Counter(slot.state for slot in slots)
        return EpochSummary(
            epoch=epoch,
            dispatched=len(slots),
            delivered=by_state[SlotState.DELIVERED],
            in_flight=by_state[SlotState.IN_FLIGHT],
            completed_waiting=by_state[SlotState.COMPLETED],
            awaiting_requeue=by_state[SlotState.AWAITING_REQUEUE],
            requeues=dict(self._epoch_requeues.get(epoch, Counter())),
            late_results=self._epoch_late[epoch],
        )

    def epoch_complete(self, epoch: int) -> bool:
        """Every prompt of the epoch was dispatched and reached the learner (needs prompts_per_epoch)."""
        if self.prompts_per_epoch is None:
            raise PromptLedgerError("epoch completeness needs prompts_per_epoch")
        summary = self.epoch_summary(epoch)
        return summary.dispatched == self.prompts_per_epoch and summary.delivered == self.prompts_per_epoch

    def check_invariants(self) -> None:
        """Raise PromptLedgerError if any prompt is lost, duplicated or double-counted."""
        problems = []
        live_ids = set()
        for slot in self._slots:
            if slot.state is SlotState.DELIVERED:
                if slot.attempt_id in self._live:
                    problems.append(f"delivered prompt {slot.prompt_id!r} (epoch {slot.epoch}) has a live attempt")
                if slot.delivered_at_step is None:
                    problems.append(f"prompt {slot.prompt_id!r} (epoch {slot.epoch}) delivered without a step")
            else:
                if self._live.get(slot.attempt_id) is not slot:
                    problems.append(
                        f"prompt {slot.prompt_id!r} (epoch {slot.epoch}) is {slot.state.value} "
                        "but has no live attempt: lost"
                    )
                live_ids.add(slot.attempt_id)
            if slot.attempts != 1 + len(slot.requeue_reasons):
                problems.append(
                    f"prompt {slot.prompt_id!r} (epoch {slot.epoch}): {slot.attempts} attempts but "
                    f"{len(slot.requeue_reasons)} re-queues"
                )
        if live_ids != set(self._live):
            problems.append(f"live attempts without a slot: {sorted(set(self._live) - live_ids)}")
        if set(self._live) & set(self._superseded):
            problems.append("an attempt is both live and superseded")
        per_epoch: dict[int, Counter] = {}
        for slot in self._slots:
            per_epoch.setdefault(slot.epoch, Counter())[slot.prompt_id] += 1
        for epoch, ids in per_epoch.items():
            duplicates = sorted(str(prompt_id) for prompt_id, n in ids.items() if n > 1)
            if duplicates:
                problems.append(f"epoch {epoch}: prompts occur more than once: {duplicates}")
            if self.prompts_per_epoch is not None and sum(ids.values()) > self.prompts_per_epoch:
                problems.append(f"epoch {epoch}: {sum(ids.values())} prompts > {self.prompts_per_epoch} per epoch")
        deliveries = Counter((epoch, prompt_id) for epoch, prompt_id, _, _ in self.delivery_log)
        repeated = sorted(f"{prompt_id} (epoch {epoch})" for (epoch, prompt_id), n in deliveries.items() if n > 1)
        if repeated:
            problems.append(f"prompts delivered to the learner more than once: {repeated}")
        if len(self.delivery_log) != self.delivered_total:
            problems.append(f"{len(self.delivery_log)} deliveries logged but {self.delivered_total} slots delivered")
        total_requeues = sum(len(slot.requeue_reasons) for slot in self._slots)
        if total_requeues != sum(self.requeues.values()):
            problems.append(f"re-queue counters ({sum(self.requeues.values())}) disagree with slots ({total_requeues})")
        if problems:
            raise PromptLedgerError("prompt ledger invariants violated:\n  - " + "\n  - ".join(problems))

    # ------------------------------------------------------------------ internals
    def _condemn(self, slot: PromptSlot, reason: str) -> None:
        slot.state = SlotState.AWAITING_REQUEUE
        slot.requeue_reasons.append(reason)
        self.requeues[reason] += 1
        self._epoch_requeues.setdefault(slot.epoch, Counter())[reason] += 1

    def _slot_of_live(self, attempt_id: str) -> PromptSlot:
        slot = self._live.get(attempt_id)
        if slot is None:
            raise PromptLedgerError(
                f"unknown attempt {attempt_id!r}: not dispatched through the ledger, or already delivered"
            )
        return slot

    def _require_new_attempt_id(self, attempt_id: str) -> None:
        if not isinstance(attempt_id, str) or not attempt_id:
            raise ValueError(f"attempt_id must be a non-empty str, got {attempt_id!r}")
        if attempt_id in self._attempt_ids:
            raise PromptLedgerError(f"attempt id {attempt_id!r} is already in use; attempt ids must be unique")


def lag_histogram(lags: Iterable[int], num_buckets: int) -> dict[str, int]:
    """Counts per lag: ``lag_0 .. lag_{num_buckets-2}`` and ``lag_ge_{num_buckets-1}`` for the tail."""
    _require_positive_int("num_buckets", num_buckets)
    top = num_buckets - 1
    counts = {f"lag_{lag}": 0 for lag in range(top)}
    counts[f"lag_ge_{top}"] = 0
    for lag in lags:
        counts[f"lag_{lag}" if lag < top else f"lag_ge_{top}"] += 1
    return counts


def _require_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


def _require_positive_int(name: str, value) -> None:
    _require_int(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def _require_reason(reason: str) -> None:
    if reason not in REQUEUE_REASONS:
        raise ValueError(f"unknown re-queue reason {reason!r}; known: {REQUEUE_REASONS}")


__all__ = [
    "LAG_STRATEGIES",
    "REQUEUE_FAILURE",
    "REQUEUE_POLICY_LAG",
    "REQUEUE_REASONS",
    "REQUEUE_TIMEOUT",
    "BatchDecision",
    "EpochSummary",
    "PromptLedger",
    "PromptLedgerError",
    "PromptSlot",
    "SlotState",
    "lag_histogram",
    "policy_lag",
]
