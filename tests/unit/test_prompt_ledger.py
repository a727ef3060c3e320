"""The prompt ledger of the asynchronous single-rollout sampler (pure, fast).

Every prompt reaches the learner exactly once per epoch; failures, aborts, timeouts and lag drops
re-queue the same prompt; results of replaced attempts are discarded and counted.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from true_on_policy.rollout.prompt_ledger import (
    REQUEUE_FAILURE,
    REQUEUE_POLICY_LAG,
    REQUEUE_TIMEOUT,
    PromptLedger,
    PromptLedgerError,
    SlotState,
    lag_histogram,
    policy_lag,
)


def dispatch(ledger: PromptLedger, prompt_ids, step: int = 1, now: float = 0.0) -> list[str]:
    attempt_ids = []
    for prompt_id in prompt_ids:
        attempt_id = f"a{len(ledger.slots())}-{prompt_id}"
        ledger.dispatched(attempt_id, prompt_id, step, now)
        attempt_ids.append(attempt_id)
    return attempt_ids


def test_batch_is_the_next_completions_in_completion_order_not_dispatch_order():
    ledger = PromptLedger(prompts_per_epoch=4)
    a = dispatch(ledger, ["p0", "p1", "p2", "p3"])
    for index in (3, 1, 0, 2):
        assert ledger.completed(a[index], 0, 0) == "accepted"

    decision = ledger.take_batch(batch_size=2, learner_step=1)

    assert decision.ready
    assert [slot.prompt_id for slot in decision.delivered] == ["p3", "p1"]
    assert ledger.count(SlotState.COMPLETED) == 2  # p0 and p2 wait for the next batch
    assert [slot.prompt_id for slot in ledger.take_batch(2, 2).delivered] == ["p0", "p2"]
    ledger.check_invariants()


def test_the_learner_waits_until_the_batch_is_full():
    ledger = PromptLedger(prompts_per_epoch=3)
    a = dispatch(ledger, ["p0", "p1", "p2"])
    ledger.completed(a[1], 0, 0)

    decision = ledger.take_batch(batch_size=2, learner_step=1)

    assert not decision.ready and decision.waiting_for == "batch_not_full"
    assert decision.delivered == ()
    assert ledger.count(SlotState.COMPLETED) == 1  # nothing taken by a batch that did not form


def test_repeated_completion_reports_are_idempotent():
    ledger = PromptLedger(prompts_per_epoch=2)
    a = dispatch(ledger, ["p0", "p1"])
    assert ledger.completed(a[0], 0, 0) == "accepted"
    assert ledger.completed(a[0], 0, 0) == "known"  # the sampler sees the same key on every poll
    ledger.completed(a[1], 0, 0)
    assert [slot.prompt_id for slot in ledger.take_batch(2, 1).delivered] == ["p0", "p1"]


def test_a_failed_rollout_requeues_the_same_prompt_and_it_reaches_the_learner_once():
    ledger = PromptLedger(prompts_per_epoch=2)
    a = dispatch(ledger, ["p0", "p1"])
    assert ledger.failed(a[0], REQUEUE_FAILURE) == "requeue"
    assert ledger.failed(a[0], REQUEUE_FAILURE) == "known"
    [slot] = ledger.awaiting_requeue()
    assert slot.prompt_id == "p0"

    ledger.requeued(a[0], "retry-p0", dispatch_step=1, now=1.0)
    ledger.completed(a[1], 0, 0)
    ledger.completed("retry-p0", 0, 0)
    decision = ledger.take_batch(2, 1)

    assert sorted(slot.prompt_id for slot in decision.delivered) == ["p0", "p1"]
    assert ledger.requeues == Counter({REQUEUE_FAILURE: 1})
    assert ledger.epoch_summary(0).requeues == {REQUEUE_FAILURE: 1}
    assert [s.attempts for s in ledger.slots()] == [2, 1]
    assert ledger.epoch_complete(0)
    ledger.check_invariants()


def test_a_timed_out_rollout_is_requeued_and_its_late_result_is_discarded():
    ledger = PromptLedger(prompts_per_epoch=1)
    [slow] = dispatch(ledger, ["p0"], now=0.0)

    assert ledger.time_out(now=5.0, timeout_s=10.0) == []
    [expired] = ledger.time_out(now=11.0, timeout_s=10.0)
    assert expired.prompt_id == "p0" and expired.state is SlotState.AWAITING_REQUEUE
    ledger.requeued(slow, "retry", dispatch_step=1, now=11.0)

    # The slow attempt still finishes: its trajectory must not reach the learner.
    assert ledger.completed(slow, 0, 0) == "late"
    ledger.late_result_discarded(slow)
    assert ledger.failed(slow) == "late"
    assert not ledger.take_batch(1, 1).ready

    ledger.completed("retry", 0, 0)
    decision = ledger.take_batch(1, 1)
    assert [slot.attempt_id for slot in decision.delivered] == ["retry"]
    assert ledger.late_results == 1 and ledger.requeues[REQUEUE_TIMEOUT] == 1
    assert ledger.epoch_summary(0).late_results == 1
    ledger.check_invariants()


def test_drop_strategy_requeues_a_trajectory_beyond_the_lag_bound():
    ledger = PromptLedger(prompts_per_epoch=3)
    a = dispatch(ledger, ["old", "p1", "p2"], step=1)
    ledger.completed(a[0], 0, 2)  # its first token came from version 0
    ledger.completed(a[1], 2, 2)
    ledger.completed(a[2], 2, 2)

    # learner step 4 trains version 3: lags are 3, 1, 1
    decision = ledger.take_batch(batch_size=2, learner_step=4, max_policy_lag=2, lag_strategy="drop")

    assert [slot.prompt_id for slot in decision.dropped_for_lag] == ["old"]
    assert [slot.prompt_id for slot in decision.delivered] == ["p1", "p2"]
    assert all(policy_lag(4, slot.min_version) <= 2 for slot in decision.delivered)
    assert ledger.requeues == Counter({REQUEUE_POLICY_LAG: 1})
    [slot] = ledger.awaiting_requeue()
    ledger.requeued(slot.attempt_id, "old-again", dispatch_step=4, now=0.0)
    ledger.completed("old-again", 3, 3)
    assert [s.prompt_id for s in ledger.take_batch(1, 4, 2, "drop").delivered] == ["old"]
    assert ledger.epoch_complete(0)
    ledger.check_invariants()


def test_wait_strategy_holds_the_learner_for_in_flight_rollouts_about_to_exceed_the_bound():
    ledger = PromptLedger(prompts_per_epoch=3)
    [early] = dispatch(ledger, ["early"], step=1)
    late = dispatch(ledger, ["late0", "late1"], step=2)
    ledger.completed(late[0], 1, 1)
    ledger.completed(late[1], 1, 1)

    # At step 2 with max lag 1: "early" (dispatched at step 1) could lag 2 at step 3, so it must
    # make this batch; the learner waits although two trajectories are ready.
    decision = ledger.take_batch(batch_size=2, learner_step=2, max_policy_lag=1, lag_strategy="wait")
    assert decision.waiting_for == "lag_bound" and decision.blocking_in_flight == 1

    ledger.completed(early, 0, 1)
    decision = ledger.take_batch(batch_size=2, learner_step=2, max_policy_lag=1, lag_strategy="wait")
    # It completed last but goes first: at step 3 its lag (2) would pass the bound.
    assert [slot.prompt_id for slot in decision.delivered] == ["early", "late0"]
    assert decision.dropped_for_lag == ()
    assert ledger.requeues == Counter()


def test_wait_strategy_still_never_delivers_beyond_the_bound():
    ledger = PromptLedger(prompts_per_epoch=3)
    a = dispatch(ledger, ["p0", "p1", "p2"], step=1)
    for attempt in a:
        ledger.completed(attempt, 0, 0)
    # Three at the bound, room for one: the other two would exceed it next step.
    assert [s.prompt_id for s in ledger.take_batch(1, 2, 1, "wait").delivered] == ["p0"]
    decision = ledger.take_batch(1, 3, 1, "wait")
    assert [s.prompt_id for s in decision.dropped_for_lag] == ["p1", "p2"]
    assert decision.delivered == () and decision.waiting_for == "batch_not_full"
    assert [slot.prompt_id for slot in ledger.awaiting_requeue()] == ["p1", "p2"]


def test_epochs_follow_the_dataloader_and_a_prompt_twice_in_one_epoch_is_an_error():
    ledger = PromptLedger(prompts_per_epoch=2)
    dispatch(ledger, ["p0", "p1", "p1", "p0"])  # epoch 0: p0 p1, epoch 1: p1 p0 (reshuffled)
    assert [slot.epoch for slot in ledger.slots()] == [0, 0, 1, 1]

    duplicated = PromptLedger(prompts_per_epoch=3)
    dispatch(duplicated, ["p0", "p1"])
    with pytest.raises(PromptLedgerError, match="prompt 'p0' is dispatched for the 2th time in epoch 0"):
        dispatch(duplicated, ["p0"])


def test_without_epoch_size_occurrences_are_numbered_per_prompt():
    ledger = PromptLedger(prompts_per_epoch=None)
    dispatch(ledger, ["p0", "p0", "p1"])
    assert [slot.epoch for slot in ledger.slots()] == [0, 1, 0]
    with pytest.raises(PromptLedgerError, match="needs prompts_per_epoch"):
        ledger.epoch_complete(0)


def test_impossible_events_raise_instead_of_losing_or_duplicating_a_prompt():
    ledger = PromptLedger(prompts_per_epoch=2)
    a = dispatch(ledger, ["p0", "p1"])
    with pytest.raises(PromptLedgerError, match="already in use"):
        ledger.dispatched(a[0], "p9", 1, 0.0)
    with pytest.raises(PromptLedgerError, match="not awaiting re-queue"):
        ledger.requeued(a[0], "x", 1, 0.0)  # re-rolling a live attempt would roll the prompt out twice
    with pytest.raises(PromptLedgerError, match="unknown attempt"):
        ledger.completed("never-dispatched", 0, 0)
    with pytest.raises(PromptLedgerError, match="min_version 2 > max_version 1"):
        ledger.completed(a[0], 2, 1)

    ledger.completed(a[0], 0, 0)
    ledger.completed(a[1], 0, 0)
    ledger.take_batch(2, 1)
    with pytest.raises(PromptLedgerError, match="already delivered"):
        ledger.completed(a[0], 0, 0)  # a delivered prompt cannot be queued for the learner again
    with pytest.raises(PromptLedgerError, match="already in use"):
        ledger.dispatched(a[0], "p0", 2, 0.0)  # nor can its attempt id be reused


def test_a_behaviour_version_newer_than_the_learner_is_rejected():
    ledger = PromptLedger(prompts_per_epoch=1)
    [attempt] = dispatch(ledger, ["p0"])
    ledger.completed(attempt, 5, 5)
    with pytest.raises(PromptLedgerError, match="newer than the learner's weights at step 3"):
        ledger.take_batch(1, 3)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be > 0"),
        ({"batch_size": 2.0}, TypeError, "batch_size must be an int"),
        ({"max_policy_lag": -1}, ValueError, "max_policy_lag must be >= 0"),
        ({"lag_strategy": "skip"}, ValueError, "lag_strategy must be one of"),
    ],
)
def test_bad_batch_arguments_name_the_problem(kwargs, error, message):
    ledger = PromptLedger(prompts_per_epoch=1)
    arguments = {"batch_size": 1, "learner_step": 1, **kwargs}
    with pytest.raises(error, match=message):
        ledger.take_batch(**arguments)


def test_bad_constructor_and_reason_arguments_name_the_problem():
    with pytest.raises(ValueError, match="prompts_per_epoch must be a positive int"):
        PromptLedger(prompts_per_epoch=0)
    ledger = PromptLedger(prompts_per_epoch=1)
    [attempt] = dispatch(ledger, ["p0"])
    with pytest.raises(ValueError, match="unknown re-queue reason 'oops'"):
        ledger.failed(attempt, "oops")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        ledger.time_out(now=1.0, timeout_s=0)


def test_lag_histogram_buckets_the_tail():
    assert lag_histogram([0, 0, 1, 3, 7], num_buckets=3) == {"lag_0": 2, "lag_1": 1, "lag_ge_2": 2}
    assert lag_histogram([], num_buckets=2) == {"lag_0": 0, "lag_ge_1": 0}


def _tick_rollouts(ledger, in_flight: dict[str, int], slow: set[str], rng, step: int, injected: Counter) -> None:
    """One tick of the rollouts in flight, in random order: a superseded attempt may finish late (discarded), a
    slow one stalls, the others fail (requeued), complete -- some at an older behaviour version -- or run on."""
    for attempt in rng.sample(sorted(in_flight), len(in_flight)):
        if ledger.is_superseded(attempt):
            if rng.random() < 0.5:  # the replaced attempt finishes after all
                version = in_flight.pop(attempt)
                assert ledger.completed(attempt, version, step - 1) == "late"
                ledger.late_result_discarded(attempt)
            continue
        if attempt in slow:
            continue
        roll = rng.random()
        if roll < 0.08:
            in_flight.pop(attempt)
            assert ledger.failed(attempt, REQUEUE_FAILURE) == "requeue"
            injected[REQUEUE_FAILURE] += 1
        elif roll < 0.5:
            version = in_flight.pop(attempt)
            # Versions older than the dispatch step stand in for trajectories stuck behind
            # others for several weight updates (partial rollouts resumed later).
            behaviour = max(0, version - rng.choice([0, 0, 0, 1, 3]))
            assert ledger.completed(attempt, behaviour, step - 1) == "accepted"


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("lag_strategy", ["drop", "wait"])
def test_every_prompt_reaches_the_learner_exactly_once_per_epoch_under_injected_faults(seed, lag_strategy):
    """Simulate the async loop: completions in random order, failures, aborts, timeouts, lag drops."""
    rng = random.Random(seed)
    prompts = [f"p{i}" for i in range(24)]
    epochs, batch_size, max_lag, timeout_s = 3, 4, 2, 6.0
    ledger = PromptLedger(prompts_per_epoch=len(prompts))
    stream = [prompt for _ in range(epochs) for prompt in rng.sample(prompts, len(prompts))]
    total = len(stream)
    in_flight: dict[str, int] = {}  # attempt id -> first version that sampled it
    slow: set[str] = set()  # attempts that will time out and still finish later
    injected = Counter()
    clock, step, next_id = 0.0, 1, 0

    def new_id() -> str:
        nonlocal next_id
        next_id += 1
        return f"attempt{next_id}"

    def requeue_all():
        for slot in ledger.awaiting_requeue():
            attempt = new_id()
            ledger.requeued(slot.attempt_id, attempt, dispatch_step=step, now=clock)
            in_flight[attempt] = step - 1

    while ledger.delivered_total < total:
        # The trainer dispatches one batch of fresh prompts per step (plus one warm-up batch).
        for _ in range(batch_size * (2 if step == 1 else 1)):
            if not stream:
                break
            attempt = new_id()
            ledger.dispatched(attempt, stream.pop(0), dispatch_step=step, now=clock)
            in_flight[attempt] = step - 1
            if rng.random() < 0.1:
                slow.add(attempt)
        # Rollouts finish, fail or stall, until the learner can take a batch.
        while True:
            clock += 1.0
            _tick_rollouts(ledger, in_flight, slow, rng, step, injected)
            for slot in ledger.time_out(now=clock, timeout_s=timeout_s):
                injected[REQUEUE_TIMEOUT] += 1
                slow.discard(slot.attempt_id)
            requeue_all()
            decision = ledger.take_batch(batch_size, step, max_lag, lag_strategy)
            injected[REQUEUE_POLICY_LAG] += len(decision.dropped_for_lag)
            requeue_all()
            ledger.check_invariants()
            if decision.ready:
                assert all(policy_lag(step, slot.min_version) <= max_lag for slot in decision.delivered)
                break
            if ledger.delivered_total + ledger.count(SlotState.COMPLETED) >= len(ledger.slots()) and not in_flight:
                break
        step += 1
        assert step < 500, "the simulated run does not converge"

    # The run exercised every fault it claims to survive.
    assert all(injected[reason] > 0 for reason in (REQUEUE_FAILURE, REQUEUE_TIMEOUT, REQUEUE_POLICY_LAG))
    for epoch in range(epochs):
        assert ledger.epoch_complete(epoch)
        delivered = Counter(prompt for e, prompt, _, _ in ledger.delivery_log if e == epoch)
        assert delivered == Counter({prompt: 1 for prompt in prompts})
    assert ledger.requeues == +injected
    per_epoch_failures = [ledger.epoch_summary(e).requeues.get(REQUEUE_FAILURE, 0) for e in range(epochs)]
    assert sum(per_epoch_failures) == injected[REQUEUE_FAILURE]
    assert ledger.count(SlotState.IN_FLIGHT) == ledger.count(SlotState.COMPLETED) == 0
    ledger.check_invariants()
