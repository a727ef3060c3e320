"""The entropy filter inside verl: its keep decisions, computed from entropies and failures by the pure
:func:`entropy_filter`, reach the registered loss as the 0/1 ``rollout_is_weights`` field, and the loss
on that mask is the pure loss on the entropies, bit for bit.

verl imports stay inside the tests (as in test_flashreinforce_in_verl.py).
"""

import math

import pytest
import torch

from true_on_policy.config.settings import ENV_VAR, Settings
from true_on_policy.loss.flashreinforce import (
    entropy_filter,
    flashreinforce_loss,
    flashreinforce_loss_from_advantages,
    kept_token_count,
    sequence_advantages,
)
from verl_actor import (
    current_log_probs,
    flashreinforce_actor_config,
    policy_batch,
    policy_loss_call,
    ppo_loss_inputs,
    token_level_rewards,
    verl_advantages,
)

F64 = torch.float64
ROWS, RESPONSE_LENGTH, HIDDEN, VOCAB = 6, 6, 4, 7
RESPONSE_LENGTHS = torch.tensor([6, 3, 5, 1, 6, 2])
FRACTION = 0.5
DELTA = 0.01
FAILED = torch.tensor([True, False, True, True, False, True])


def make_batch():
    """A linear softmax policy, responses of varied length, behaviour log-probs that drift by a per-row
    amount (the gate rejects some rows), token entropies with ties, and rewards with failures."""
    generator = torch.Generator().manual_seed(4321)
    drift = [0.0, 0.02, 0.01, 0.05, 0.8, 0.0]
    batch = policy_batch(
        generator, RESPONSE_LENGTHS, response_length=RESPONSE_LENGTH, hidden=HIDDEN, vocab=VOCAB, drift=drift
    )
    # rounded to one decimal: ties inside rows, broken by position
    entropies = torch.rand(ROWS, RESPONSE_LENGTH, generator=generator, dtype=F64).mul(10).round().div(10)
    entropies = torch.where(batch["mask"], entropies, torch.full((), math.nan, dtype=F64))  # padding may hold anything
    rewards = torch.where(FAILED, torch.zeros((), dtype=F64), torch.tensor([1.0, 0.7, 1.0, 0.4, 0.9, 0.6], dtype=F64))
    return dict(
        **batch,
        entropies=entropies,
        rewards=rewards,
        token_level_rewards=token_level_rewards(rewards, RESPONSE_LENGTHS, RESPONSE_LENGTH),
    )


def pure_reference(batch):
    """The pure loss with entropies and failures on the whole batch: loss, gradient, stats."""
    weight = batch["weight"].clone().requires_grad_(True)
    current = current_log_probs(batch["features"], weight, batch["tokens"])
    loss, stats = flashreinforce_loss(
        current,
        batch["behaviour"],
        batch["rewards"],
        batch["mask"],
        delta=DELTA,
        negative_token_fraction=FRACTION,
        entropies=batch["entropies"],
        failures=FAILED,
    )
    loss.backward()
    return loss.detach(), weight.grad, stats


def filter_carrier(batch, rows=None):
    """What the trainer hook writes: the keep mask as float 0/1, 0 on padding."""
    keep = entropy_filter(batch["mask"], batch["entropies"], FAILED, FRACTION)
    carrier = keep.to(torch.float32)
    return carrier if rows is None else carrier[torch.tensor(rows)]


@pytest.fixture
def filter_settings(monkeypatch):
    settings = Settings(platform="cpu", delta=DELTA, negative_token_fraction=FRACTION)
    monkeypatch.setenv(ENV_VAR, settings.to_json())


def call_policy_loss(batch, *, rows=None, weight=None, **overrides):
    """The registered loss called the way ppo_loss calls it, on ``rows``, with the filter carrier."""
    index = torch.arange(ROWS) if rows is None else torch.tensor(rows)
    if "rollout_is_weights" not in overrides:
        overrides["rollout_is_weights"] = filter_carrier(batch, rows)
    weight = batch["weight"] if weight is None else weight
    return policy_loss_call(
        batch, index, mini_batch=ROWS, weight=weight, dp_size=1, global_batch_size=ROWS, **overrides
    )


# --- the pure filter and the kept_tokens path -------------------------------------------------------------


def test_public_filter_keeps_ceil_q_t_highest_entropy_tokens_of_failed_rows_only():
    batch = make_batch()
    keep = entropy_filter(batch["mask"], batch["entropies"], FAILED, FRACTION)
    assert keep.dtype == torch.bool and not bool((keep & ~batch["mask"]).any())
    for row in range(ROWS):
        length = int(RESPONSE_LENGTHS[row])
        kept = keep[row, :length]
        if not FAILED[row]:
            assert kept.all()
            continue
        assert int(kept.sum()) == math.ceil(FRACTION * length)
        # every kept token's entropy is >= every dropped token's, and ties go to the earlier position
        entropies = batch["entropies"][row, :length].tolist()
        ranked = sorted(range(length), key=lambda t: (-entropies[t], t))
        assert kept.nonzero().flatten().tolist() == sorted(ranked[: math.ceil(FRACTION * length)])


def test_public_filter_keeps_nothing_in_a_row_without_policy_tokens():
    mask = torch.tensor([[True, True], [False, False]])
    keep = entropy_filter(mask, torch.ones(2, 2), torch.tensor([True, True]), 0.5)
    assert keep.tolist() == [[True, False], [False, False]]


@pytest.mark.parametrize(("fraction", "tokens", "kept"), [(0.5, 5, 3), (0.28, 25, 7), (0.0, 4, 0), (1.0, 3, 3)])
def test_kept_token_count_is_the_exact_ceiling(fraction, tokens, kept):
    assert kept_token_count(fraction, tokens) == kept


def test_kept_tokens_path_equals_the_entropy_path_bitwise():
    batch = make_batch()
    advantages = sequence_advantages(batch["rewards"])
    keep = entropy_filter(batch["mask"], batch["entropies"], FAILED, FRACTION)
    results = []
    for options in (
        dict(negative_token_fraction=FRACTION, entropies=batch["entropies"], failures=FAILED),
        dict(kept_tokens=keep),
    ):
        weight = batch["weight"].clone().requires_grad_(True)
        current = current_log_probs(batch["features"], weight, batch["tokens"])
        loss, stats = flashreinforce_loss_from_advantages(
            current, batch["behaviour"], advantages, batch["mask"], batch_size=ROWS, delta=DELTA, **options
        )
        loss.backward()
        results.append((loss.detach(), weight.grad, stats))
    (loss_a, grad_a, stats_a), (loss_b, grad_b, stats_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    for key in stats_a:
        assert torch.equal(stats_a[key], stats_b[key]), key
    # the filter and the gate both act in this batch, and T_i stays the original count
    assert 0 < int(stats_a["admitted"].sum()) < ROWS
    assert int(stats_a["retained_tokens"].sum()) < int(stats_a["policy_tokens"][stats_a["admitted"]].sum())
    assert stats_a["policy_tokens"].tolist() == RESPONSE_LENGTHS.tolist()


@pytest.mark.parametrize(
    ("kept_tokens", "extra", "message"),
    [
        (lambda mask: mask.float(), {}, "kept_tokens must be a bool tensor"),
        (lambda mask: mask[:, :-1], {}, "shape mismatch: kept_tokens"),
        (lambda mask: torch.ones_like(mask), {}, "subset of action_mask"),
        (lambda mask: mask, dict(negative_token_fraction=0.5), "not both"),
        (lambda mask: mask, dict(entropies=torch.zeros(ROWS, RESPONSE_LENGTH, dtype=F64)), "not both"),
    ],
)
def test_kept_tokens_are_validated(kept_tokens, extra, message):
    batch = make_batch()
    with pytest.raises(ValueError, match=message):
        flashreinforce_loss_from_advantages(
            batch["behaviour"].clone(),
            batch["behaviour"],
            sequence_advantages(batch["rewards"]),
            batch["mask"],
            batch_size=ROWS,
            kept_tokens=kept_tokens(batch["mask"]),
            **extra,
        )


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(failures=torch.tensor([1, 0])), "failures must be an explicit bool"),
        (dict(entropies=torch.zeros(2, 3)), "shape mismatch: entropies"),
        (dict(entropies=torch.tensor([[0.0, math.nan], [0.0, 0.0]])), "entropies must be finite"),
        (dict(negative_token_fraction=1.5), r"negative_token_fraction must be .* \[0, 1\]"),
        (dict(action_mask=torch.ones(2, 2)), "action_mask must be a bool tensor"),
    ],
)
def test_public_filter_validates_its_inputs(arguments, message):
    inputs = dict(
        action_mask=torch.ones(2, 2, dtype=torch.bool),
        entropies=torch.zeros(2, 2),
        failures=torch.tensor([True, False]),
        negative_token_fraction=0.5,
    )
    inputs.update(arguments)
    with pytest.raises(ValueError, match=message):
        entropy_filter(**inputs)


# --- the registered loss reads rollout_is_weights as the filter mask ------------------------------------


def test_registered_loss_on_the_mask_is_the_pure_loss_on_entropies_bitwise(filter_settings):
    batch = make_batch()
    expected_loss, expected_grad, stats = pure_reference(batch)
    assert int(FAILED.sum()) > 0 and 0 < int(stats["admitted"].sum()) < ROWS

    weight = batch["weight"].clone().requires_grad_(True)
    loss, metrics = call_policy_loss(batch, weight=weight)
    loss.backward()
    assert torch.equal(loss.detach(), expected_loss)
    assert torch.equal(weight.grad, expected_grad)
    retained = stats["retained_tokens"].sum() / stats["policy_tokens"].sum()
    assert metrics["actor/flashreinforce/retained_token_fraction"] == retained.item() < 1.0
    assert metrics["actor/flashreinforce/acceptance_rate"] == stats["acceptance_rate"].item()


@pytest.mark.parametrize("micro_batches", [[[0, 1, 2, 3, 4, 5]], [[0, 1], [2, 3, 4], [5]], [[3], [0, 5], [1], [2, 4]]])
def test_the_mask_travels_through_verls_ppo_loss_and_micro_batches(filter_settings, micro_batches):
    from verl.workers.utils.losses import ppo_loss

    batch = make_batch()
    expected_loss, expected_grad, _ = pure_reference(batch)
    config = flashreinforce_actor_config(ROWS)
    advantages = verl_advantages(batch)
    carrier = filter_carrier(batch)
    weight = batch["weight"].clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for rows in micro_batches:
        model_output, data = ppo_loss_inputs(
            batch, weight, advantages, rows, dp_size=1, global_batch_size=ROWS, fields={"rollout_is_weights": carrier}
        )
        loss, _ = ppo_loss(config, model_output, data)
        loss.backward()
        total += loss.detach()
    if len(micro_batches) == 1:
        assert torch.equal(weight.grad, expected_grad) and torch.equal(total, expected_loss)
    else:
        torch.testing.assert_close(weight.grad, expected_grad, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(total, expected_loss, rtol=1e-12, atol=1e-15)


def test_padding_rows_in_a_micro_batch_with_the_mask(filter_settings):
    batch = make_batch()
    padded = dict(batch)
    for key in ("features", "tokens", "behaviour", "token_level_rewards", "entropies"):
        padded[key] = torch.cat([batch[key], batch[key][:1]])
    padded["mask"] = torch.cat([batch["mask"], torch.zeros(1, RESPONSE_LENGTH, dtype=torch.bool)])
    carrier = torch.cat([filter_carrier(batch), torch.zeros(1, RESPONSE_LENGTH)])
    loss_without, _ = call_policy_loss(batch)
    # the advantage estimator leaves the padding row out of the mean, so the rows keep their advantages
    loss_with, _ = call_policy_loss(
        padded,
        rows=list(range(ROWS + 1)),
        advantages=verl_advantages(padded),
        rollout_is_weights=carrier,
    )
    assert torch.equal(loss_with, loss_without)


def mask_with(batch, row, positions, value):
    carrier = filter_carrier(batch).clone()
    carrier[row, positions] = value
    return carrier


@pytest.mark.parametrize(
    ("carrier", "message"),
    [
        (lambda batch: None, "needs the entropy filter's per-token keep mask"),
        (lambda batch: filter_carrier(batch)[:, :-1], "must have the response's shape"),
    ],
)
def test_the_loss_refuses_a_missing_or_misshapen_filter_mask(filter_settings, carrier, message):
    batch = make_batch()
    with pytest.raises(ValueError, match=message):
        call_policy_loss(batch, rollout_is_weights=carrier(batch))


@pytest.mark.parametrize(
    ("carrier", "message"),
    [
        (lambda batch: mask_with(batch, 0, 0, 0.5), "0/1 keep mask .*importance weights"),
        (lambda batch: mask_with(batch, 0, 0, math.nan), "0/1 keep mask"),
        (lambda batch: mask_with(batch, 3, 4, 1.0), "outside the response"),
        # per-row counts: a row keeps all its T_i tokens or ceil(q * T_i); row 1 (T = 3) keeping 1 is neither
        (lambda batch: mask_with(batch, 1, [0, 1], 0.0), "keeps 1 of the 3"),
        (lambda batch: torch.where(batch["mask"], 1.0, 0.0).index_fill(0, torch.tensor([0]), 0.0), "keeps 0 of the 6"),
    ],
)
def test_the_driver_refuses_anything_but_a_valid_filter_mask(carrier, message):
    """Checked once per batch in the driver (the per-micro-batch loss reads no value on the host)."""
    from true_on_policy.verl_adapter import trainer_hooks

    batch = make_batch()
    trainer_hooks.check_filter_mask(filter_carrier(batch), batch["mask"], FRACTION)  # the twin: the hook's own mask
    with pytest.raises(ValueError, match=message):
        trainer_hooks.check_filter_mask(carrier(batch), batch["mask"], FRACTION)


def test_a_failed_row_keeping_too_many_tokens_is_refused():
    from true_on_policy.verl_adapter import trainer_hooks

    batch = make_batch()
    carrier = filter_carrier(batch)
    dropped = ((carrier[0] == 0) & batch["mask"][0]).nonzero().flatten()
    carrier[0, dropped[0]] = 1.0  # failed row 0 now keeps 4 of 6: neither 6 nor ceil(0.5 * 6) = 3
    with pytest.raises(ValueError, match="keeps 4 of the 6 response tokens of row 0"):
        trainer_hooks.check_filter_mask(carrier, batch["mask"], FRACTION)


def test_without_the_filter_importance_weights_are_still_refused(monkeypatch):
    monkeypatch.setenv(ENV_VAR, Settings(platform="cpu", delta=DELTA).to_json())
    batch = make_batch()
    with pytest.raises(ValueError, match="rollout_is=null"):
        call_policy_loss(batch, rollout_is_weights=torch.ones(ROWS, RESPONSE_LENGTH))
    loss, _ = call_policy_loss(batch, rollout_is_weights=None)  # and no field: the plain loss
    assert torch.isfinite(loss)
