"""The FlashREINFORCE reference loss, case by case, against hand-computed values and gradients.

For an active token d loss / d cur_it = -(1/B) (A_i / T_i) exp(cur_it - beh_it); every expected
gradient below is written out from that closed form, never by re-running the loss.
"""

import math

import pytest
import torch

from true_on_policy.loss.flashreinforce import (
    STATS_KEYS,
    flashreinforce_loss,
    flashreinforce_loss_from_advantages,
    sequence_advantages,
)

F64 = torch.float64


def log(values):
    return torch.tensor(values, dtype=F64).log()


def leaf(values):
    return values.clone().requires_grad_(True)


def full_mask(rows, length):
    return torch.ones(rows, length, dtype=torch.bool)


def no_rewards(rows):
    return torch.zeros(rows, dtype=F64)


def bernoulli_kl(p, q):
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


# --- values and gradients -------------------------------------------------------------------------


def test_loss_and_gradient_match_closed_form():
    # Row 0: 2 policy tokens, ratio 1. Row 1: 3 policy tokens, ratios 2, 1/2, 1.
    current = leaf(log([[0.5, 0.25, 0.9], [0.5, 0.25, 0.2]]))
    behaviour = log([[0.5, 0.25, 0.9], [0.25, 0.5, 0.2]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    rewards = torch.tensor([1.0, 0.0], dtype=F64)  # A = [+0.5, -0.5]

    loss, stats = flashreinforce_loss(current, behaviour, rewards, mask, delta=math.inf)
    loss.backward()

    expected_loss = -(1 / 2) * (
        (0.5 / 2) * (math.log(0.5) + math.log(0.25))
        + (-0.5 / 3) * (2 * math.log(0.5) + 0.5 * math.log(0.25) + 1 * math.log(0.2))
    )
    expected_grad = torch.tensor(
        [[-(1 / 2) * (0.5 / 2), -(1 / 2) * (0.5 / 2), 0.0], [1 / 12 * 2, 1 / 12 * 0.5, 1 / 12 * 1]], dtype=F64
    )
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12)
    torch.testing.assert_close(current.grad, expected_grad, rtol=1e-12, atol=0)
    assert stats["advantages"].tolist() == [0.5, -0.5]
    assert stats["policy_tokens"].tolist() == [2, 3]
    assert stats["retained_tokens"].tolist() == [2, 3]
    assert stats["admitted"].tolist() == [True, True]
    assert stats["acceptance_rate"].item() == 1.0
    # mean |ratio - 1| over the 5 active tokens: (0 + 0 + 1 + 0.5 + 0) / 5
    assert stats["ratio_deviation"].item() == pytest.approx(0.3, rel=1e-12)


def test_no_gradient_reaches_behaviour_or_rewards_and_stats_are_detached():
    current = leaf(log([[0.5, 0.4]]).repeat(2, 1))
    behaviour = leaf(log([[0.45, 0.4]]).repeat(2, 1))
    rewards = torch.tensor([1.0, 3.0], dtype=F64, requires_grad=True)
    loss, stats = flashreinforce_loss(current, behaviour, rewards, torch.ones(2, 2, dtype=torch.bool), delta=math.inf)
    loss.backward()
    assert behaviour.grad is None and rewards.grad is None
    assert set(stats) == set(STATS_KEYS)
    assert all(not value.requires_grad for value in stats.values())


def test_advantage_baseline_is_the_whole_batch_mean():
    current = leaf(torch.full((3, 1), math.log(0.5), dtype=F64))
    rewards = torch.tensor([3.0, 0.0, 0.0], dtype=F64)
    loss, stats = flashreinforce_loss(current, current.detach(), rewards, torch.ones(3, 1, dtype=torch.bool))
    loss.backward()
    assert stats["advantages"].tolist() == [2.0, -1.0, -1.0]
    # one token per row, ratio 1: grad = -(1/3) * A_i
    torch.testing.assert_close(current.grad, torch.tensor([[-2 / 3], [1 / 3], [1 / 3]], dtype=F64), rtol=1e-12, atol=0)


def test_advantage_baseline_does_not_depend_on_the_row_order():
    """verl reorders a batch to balance data-parallel ranks (a different order at DP 1 and DP 2): the
    baseline is the same bits for every order of the rows, so each row's advantage is too. Twin: a
    plain mean over the rows as they come changes its last bits under a reordering."""
    generator = torch.Generator().manual_seed(0)
    plain_differs = 0
    for _ in range(50):
        rewards = torch.rand(32, generator=generator)
        order = torch.randperm(32, generator=generator)
        assert torch.equal(sequence_advantages(rewards)[order], sequence_advantages(rewards[order]))
        plain_differs += not torch.equal(rewards.mean(), rewards[order].mean())
    assert plain_differs > 0


# --- the trust-region gate ------------------------------------------------------------------------


def test_sequence_kl_is_the_mean_bernoulli_kl_over_policy_tokens():
    current = log([[0.25, 0.6, 0.3]])
    behaviour = log([[0.5, 0.6, 0.9]])
    mask = torch.tensor([[True, True, False]])  # the third token (with its large KL) is not a policy token
    _, stats = flashreinforce_loss(current, behaviour, torch.zeros(1, dtype=F64), mask, delta=math.inf)
    expected = (bernoulli_kl(0.5, 0.25) + bernoulli_kl(0.6, 0.6)) / 2
    assert stats["sequence_kl"].item() == pytest.approx(expected, rel=1e-12)


def test_probabilities_are_clamped_into_the_open_unit_interval():
    # behaviour probability 1 and current probability e^-50 would make the KL infinite unclamped.
    current = torch.tensor([[-50.0]], dtype=F64)
    behaviour = torch.tensor([[0.0]], dtype=F64)
    _, stats = flashreinforce_loss(current, behaviour, no_rewards(1), full_mask(1, 1), delta=math.inf)
    assert stats["sequence_kl"].item() == pytest.approx(bernoulli_kl(1 - 1e-6, 1e-6), rel=1e-9)


def test_rejected_row_has_zero_gradient_and_still_counts_in_the_batch_size():
    current = leaf(log([[0.5, 0.5], [0.5, 0.5], [0.9, 0.9]]))
    behaviour = log([[0.5, 0.5], [0.5, 0.5], [0.1, 0.1]])  # row 2 is far off-policy
    rewards = torch.tensor([2.0, 0.0, 1.0], dtype=F64)  # mean 1: A = [1, -1, 0]
    loss, stats = flashreinforce_loss(current, behaviour, rewards, torch.ones(3, 2, dtype=torch.bool), delta=0.01)
    loss.backward()
    assert stats["admitted"].tolist() == [True, True, False]
    assert stats["acceptance_rate"].item() == pytest.approx(2 / 3)
    assert stats["retained_tokens"].tolist() == [2, 2, 0]
    # B stays 3, T_i stays 2: grad = -(1/3) * A_i / 2 on admitted rows, 0 on the rejected one
    expected = torch.tensor([[-1 / 6, -1 / 6], [1 / 6, 1 / 6], [0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(current.grad, expected, rtol=1e-12, atol=0)


def test_gate_boundary_is_inclusive():
    current = log([[0.25, 0.5]])
    behaviour = log([[0.5, 0.5]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, stats = flashreinforce_loss(current, behaviour, torch.zeros(1, dtype=F64), mask, delta=math.inf)
    kl = stats["sequence_kl"].item()
    assert kl == pytest.approx(bernoulli_kl(0.5, 0.25) / 2, rel=1e-12)

    _, at_boundary = flashreinforce_loss(current, behaviour, torch.zeros(1, dtype=F64), mask, delta=kl)
    _, just_below = flashreinforce_loss(
        current, behaviour, torch.zeros(1, dtype=F64), mask, delta=math.nextafter(kl, 0.0)
    )
    assert at_boundary["admitted"].tolist() == [True]
    assert just_below["admitted"].tolist() == [False]


def test_delta_zero_admits_exactly_on_policy_rows():
    current = log([[0.3, 0.7], [0.3, 0.7]])
    behaviour = log([[0.3, 0.7], [0.3, 0.71]])
    _, stats = flashreinforce_loss(current, behaviour, no_rewards(2), full_mask(2, 2), delta=0.0)
    assert stats["sequence_kl"][0].item() == 0.0
    assert stats["admitted"].tolist() == [True, False]


def test_infinite_delta_disables_the_gate():
    current = log([[0.999, 0.999]])
    behaviour = log([[0.001, 0.001]])
    _, stats = flashreinforce_loss(current, behaviour, no_rewards(1), full_mask(1, 2), delta=math.inf)
    assert stats["sequence_kl"].item() > 5
    assert stats["admitted"].tolist() == [True]


# --- the entropy filter ---------------------------------------------------------------------------


def filter_case(entropies, fraction, failures, rewards=None, mask=None):
    """On-policy batch (ratio 1, gate open) so the gradient pattern shows exactly the kept tokens."""
    entropies = torch.tensor(entropies, dtype=F64)
    rows, length = entropies.shape
    current = leaf(torch.full((rows, length), math.log(0.5), dtype=F64))
    mask = torch.ones(rows, length, dtype=torch.bool) if mask is None else torch.tensor(mask)
    rewards = torch.arange(rows, dtype=F64) if rewards is None else torch.tensor(rewards, dtype=F64)
    loss, stats = flashreinforce_loss(
        current,
        current.detach(),
        rewards,
        mask,
        delta=math.inf,
        negative_token_fraction=fraction,
        entropies=entropies,
        failures=torch.tensor(failures),
    )
    loss.backward()
    return current.grad, stats


def test_filter_keeps_the_highest_entropy_tokens_of_failed_rows():
    grad, stats = filter_case([[0.5, 0.9, 0.8, 0.1], [0.5, 0.9, 0.8, 0.1]], 0.5, [True, False], rewards=[0.0, 1.0])
    # A = [-0.5, 0.5], T = 4, B = 2: kept tokens get -(1/2) * A_i / 4
    expected = torch.tensor([[0.0, 1 / 16, 1 / 16, 0.0], [-1 / 16] * 4], dtype=F64)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=0)
    assert stats["retained_tokens"].tolist() == [2, 4]
    assert stats["policy_tokens"].tolist() == [4, 4]


def test_filter_ties_go_to_the_earlier_position():
    # Three tokens tie at 0.9 for two places: positions 0 and 2 win over 3.
    grad, stats = filter_case([[0.9, 0.5, 0.9, 0.9], [0.0] * 4], 0.5, [True, False])
    assert (grad[0] != 0).tolist() == [True, False, True, False]
    assert stats["retained_tokens"].tolist() == [2, 4]


def test_filter_ties_go_to_the_earlier_position_in_a_long_row():
    # 22 tokens tie at the top entropy for ceil(11/64 * 64) = 11 places: the first 11 of them win.
    # (Long enough that an unstable sort would scramble the ties.)
    length = 64
    entropies = [[1.0 if position % 3 == 0 else 0.0 for position in range(length)], [0.0] * length]
    grad, stats = filter_case(entropies, 11 / 64, [True, False])
    kept = torch.nonzero(grad[0]).flatten().tolist()
    assert kept == [3 * k for k in range(11)]
    assert stats["retained_tokens"].tolist() == [11, length]


def test_filter_follows_failures_not_the_sign_of_the_advantage():
    # Row 0 failed with a positive advantage; row 1 succeeded with a negative one.
    grad, stats = filter_case([[0.1, 0.9], [0.1, 0.9]], 0.5, [True, False], rewards=[1.0, 0.0])
    assert (grad != 0).tolist() == [[False, True], [True, True]]
    assert stats["advantages"].tolist() == [0.5, -0.5]
    assert stats["retained_tokens"].tolist() == [1, 2]


@pytest.mark.parametrize(
    ("fraction", "length", "kept"),
    [
        (0.3, 4, 2),  # ceil(1.2)
        (0.5, 4, 2),  # exact
        (0.28, 25, 7),  # 0.28 * 25 is 7.000000000000001 in floating point; ceil must still be 7
        (0.07, 100, 7),
        (0.0, 4, 0),  # nothing of a failed row survives
        (1.0, 4, 4),
    ],
)
def test_filter_keeps_ceil_of_fraction_times_policy_tokens(fraction, length, kept):
    entropies = [[float(t) for t in range(length)], [0.0] * length]
    _, stats = filter_case(entropies, fraction, [True, False])
    assert stats["retained_tokens"].tolist() == [kept, length]
    assert stats["policy_tokens"].tolist() == [length, length]


def test_filter_counts_only_policy_tokens_and_never_keeps_masked_ones():
    # T_0 = 3 policy tokens -> keep ceil(0.5 * 3) = 2; the masked position has the top (NaN-free) entropy.
    grad, stats = filter_case(
        [[0.7, 99.0, 0.2, 0.5], [0.0] * 4],
        0.5,
        [True, False],
        mask=[[True, False, True, True], [True] * 4],
    )
    assert (grad[0] != 0).tolist() == [True, False, False, True]
    assert stats["retained_tokens"].tolist() == [2, 4]


def test_filtered_denominators_stay_the_original_token_count():
    grad, _ = filter_case([[0.1, 0.9], [0.0, 0.0]], 0.5, [True, False], rewards=[0.0, 2.0])
    # A_0 = -1, T_0 = 2 (not 1), B = 2
    assert grad[0, 1].item() == pytest.approx(-(1 / 2) * (-1 / 2), rel=1e-12)


# --- masked values, overflow ----------------------------------------------------------------------


def test_masked_nan_and_inf_affect_neither_loss_nor_gradient():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    clean_current = log([[0.5, 0.25, 0.5], [0.6, 0.5, 0.5]])
    clean_behaviour = log([[0.45, 0.25, 0.5], [0.6, 0.5, 0.5]])
    dirty_current = clean_current.clone()
    dirty_current[0, 2], dirty_current[1, 1], dirty_current[1, 2] = math.nan, math.inf, 5.0
    dirty_behaviour = clean_behaviour.clone()
    dirty_behaviour[0, 2], dirty_behaviour[1, 1], dirty_behaviour[1, 2] = -math.inf, math.nan, 7.0
    entropies = torch.tensor([[0.3, 0.2, math.nan], [0.1, math.inf, math.nan]], dtype=F64)
    rewards = torch.tensor([1.0, 0.0], dtype=F64)
    failures = torch.tensor([True, True])
    options = dict(delta=math.inf, negative_token_fraction=0.5, entropies=entropies, failures=failures)

    results = []
    for current, behaviour in ((clean_current, clean_behaviour), (dirty_current, dirty_behaviour)):
        current = leaf(current)
        loss, stats = flashreinforce_loss(current, behaviour, rewards, mask, **options)
        loss.backward()
        results.append((loss, current.grad, stats))
    (clean_loss, clean_grad, clean_stats), (dirty_loss, dirty_grad, dirty_stats) = results
    assert torch.isfinite(dirty_loss) and dirty_loss.item() == clean_loss.item()
    assert torch.equal(dirty_grad, clean_grad)
    assert dirty_grad[~mask].eq(0).all()
    assert torch.equal(dirty_stats["sequence_kl"], clean_stats["sequence_kl"])


def test_rejected_rows_never_exponentiate_their_ratio():
    # exp(999.9) overflows float64; row 1 is rejected by the gate, so nothing may overflow or raise.
    current = leaf(torch.tensor([[-0.7, -0.7], [-0.1, -0.1]], dtype=F64))
    behaviour = torch.tensor([[-0.7, -0.7], [-1000.0, -1000.0]], dtype=F64)
    loss, stats = flashreinforce_loss(current, behaviour, torch.tensor([1.0, 0.0], dtype=F64), full_mask(2, 2))
    loss.backward()
    assert stats["admitted"].tolist() == [True, False]
    assert torch.isfinite(loss) and torch.isfinite(current.grad).all()
    assert current.grad[1].eq(0).all()


def test_filtered_tokens_never_exponentiate_their_ratio():
    current = leaf(torch.tensor([[-0.1, -0.7], [-0.7, -0.7]], dtype=F64))
    behaviour = torch.tensor([[-1000.0, -0.7], [-0.7, -0.7]], dtype=F64)
    loss, stats = flashreinforce_loss(
        current,
        behaviour,
        torch.tensor([0.0, 1.0], dtype=F64),
        torch.ones(2, 2, dtype=torch.bool),
        delta=math.inf,
        negative_token_fraction=0.5,
        entropies=torch.tensor([[0.1, 0.9], [0.5, 0.5]], dtype=F64),  # the overflowing token has low entropy
        failures=torch.tensor([True, False]),
    )
    loss.backward()
    assert stats["retained_tokens"].tolist() == [1, 2]
    assert torch.isfinite(loss) and current.grad[0, 0].item() == 0.0


def test_non_finite_ratio_on_an_active_token_raises():
    current = torch.tensor([[-0.1, -0.1]], dtype=F64)
    behaviour = torch.tensor([[-1000.0, -0.1]], dtype=F64)
    with pytest.raises(FloatingPointError, match="not finite on active tokens"):
        flashreinforce_loss(current, behaviour, no_rewards(1), full_mask(1, 2), delta=math.inf)


def test_float32_overflow_is_detected_in_float32():
    # exp(100) is finite in float64 but inf in float32, the dtype the loss computes in here.
    current = torch.tensor([[-0.1]], dtype=torch.float32)
    behaviour = torch.tensor([[-100.1]], dtype=torch.float32)
    with pytest.raises(FloatingPointError):
        flashreinforce_loss(current, behaviour, torch.zeros(1), torch.ones(1, 1, dtype=torch.bool), delta=math.inf)


# --- dtypes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("current_dtype", "behaviour_dtype", "loss_dtype"),
    [
        (torch.bfloat16, torch.bfloat16, torch.float32),
        (torch.float16, torch.float16, torch.float32),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float32, torch.float32, torch.float32),
        (torch.float64, torch.float64, torch.float64),
        (torch.float32, torch.float64, torch.float64),
    ],
)
def test_dtype_promotion(current_dtype, behaviour_dtype, loss_dtype):
    current = torch.tensor([[-0.5, -1.0], [-0.25, -2.0]], dtype=current_dtype, requires_grad=True)
    behaviour = current.detach().to(behaviour_dtype)
    loss, stats = flashreinforce_loss(current, behaviour, torch.tensor([1, 0]), torch.ones(2, 2, dtype=torch.bool))
    loss.backward()
    assert loss.dtype == loss_dtype
    assert stats["sequence_kl"].dtype == loss_dtype and stats["advantages"].dtype == loss_dtype
    assert current.grad.dtype == current_dtype
    # ratio 1, A = [0.5, -0.5], T = 2, B = 2: grad = -A_i / 4, exactly representable in every dtype
    expected = torch.tensor([[-0.125, -0.125], [0.125, 0.125]], dtype=current_dtype)
    assert torch.equal(current.grad, expected)


# --- slices of a batch ------------------------------------------------------------------------------


def test_slices_with_the_batch_size_sum_to_the_whole_batch():
    generator = torch.Generator().manual_seed(0)
    rows, length = 7, 5
    current = leaf(-torch.rand(rows, length, generator=generator, dtype=F64) - 0.05)
    behaviour = current.detach() + 0.05 * torch.randn(rows, length, generator=generator, dtype=F64)
    behaviour = behaviour.clamp(max=-1e-3)
    mask = torch.rand(rows, length, generator=generator) < 0.8
    mask[:, 0] = True
    rewards = torch.rand(rows, generator=generator, dtype=F64)

    whole, whole_stats = flashreinforce_loss(current, behaviour, rewards, mask, delta=2e-3)
    (whole_grad,) = torch.autograd.grad(whole, current)
    assert 0 < whole_stats["admitted"].sum() < rows  # the gate matters in this batch

    advantages = rewards - rewards.mean()
    parts = [slice(0, 2), slice(2, 3), slice(3, 7)]
    total = sum(
        flashreinforce_loss_from_advantages(
            current[part], behaviour[part], advantages[part], mask[part], batch_size=rows, delta=2e-3
        )[0]
        for part in parts
    )
    (sliced_grad,) = torch.autograd.grad(total, current)
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=0)
    torch.testing.assert_close(sliced_grad, whole_grad, rtol=1e-12, atol=0)


# --- bad input ----------------------------------------------------------------------------------------


def good_inputs():
    return dict(
        log_probs=torch.tensor([[-0.5, -1.0], [-0.2, -0.3]]),
        behavior_log_probs=torch.tensor([[-0.5, -1.0], [-0.2, -0.3]]),
        rewards=torch.tensor([1.0, 0.0]),
        action_mask=torch.tensor([[True, False], [True, True]]),
    )


def with_changes(**changes):
    inputs = good_inputs()
    inputs.update(changes)
    return inputs


BAD_INPUTS = {
    "log_probs 1-D": (with_changes(log_probs=torch.tensor([-0.5, -1.0])), "log_probs must be 2-D"),
    "log_probs empty": (
        with_changes(
            log_probs=torch.zeros(0, 2),
            behavior_log_probs=torch.zeros(0, 2),
            rewards=torch.zeros(0),
            action_mask=torch.zeros(0, 2, dtype=torch.bool),
        ),
        "must not be empty",
    ),
    "log_probs integer": (
        with_changes(log_probs=torch.tensor([[0, -1], [0, 0]])),
        "log_probs must be a floating-point",
    ),
    "behaviour integer": (
        with_changes(behavior_log_probs=torch.tensor([[0, -1], [0, 0]])),
        "behavior_log_probs must be a floating-point",
    ),
    "behaviour shape": (with_changes(behavior_log_probs=torch.zeros(2, 3)), "shape mismatch"),
    "mask shape": (with_changes(action_mask=torch.ones(2, 3, dtype=torch.bool)), "shape mismatch: action_mask"),
    "mask not bool": (with_changes(action_mask=torch.ones(2, 2)), "action_mask must be a bool"),
    "rewards 2-D": (with_changes(rewards=torch.zeros(2, 1)), r"rewards must have shape \[B\]"),
    "rewards wrong length": (with_changes(rewards=torch.zeros(3)), r"rewards must have shape \[B\]"),
    "rewards nan": (with_changes(rewards=torch.tensor([1.0, math.nan])), "rewards must be finite"),
    "rewards inf": (with_changes(rewards=torch.tensor([math.inf, 0.0])), "rewards must be finite"),
    "rewards bool": (with_changes(rewards=torch.tensor([True, False])), "real-valued"),
    "empty row": (with_changes(action_mask=torch.tensor([[True, True], [False, False]])), r"rows \[1\] have none"),
    "policy log-prob positive": (
        with_changes(log_probs=torch.tensor([[0.5, -1.0], [-0.2, -0.3]])),
        "log_probs must be finite and <= 0",
    ),
    "policy log-prob nan": (
        with_changes(log_probs=torch.tensor([[-0.5, -1.0], [math.nan, -0.3]])),
        "log_probs must be finite",
    ),
    "policy behaviour -inf": (
        with_changes(behavior_log_probs=torch.tensor([[-math.inf, -1.0], [-0.2, -0.3]])),
        "behavior_log_probs must be finite",
    ),
    "delta nan": (with_changes(delta=math.nan), "delta must be a number >= 0"),
    "delta negative": (with_changes(delta=-1e-3), "delta must be a number >= 0"),
    "fraction above 1": (with_changes(negative_token_fraction=1.5), r"negative_token_fraction must be .* \[0, 1\]"),
    "fraction negative": (with_changes(negative_token_fraction=-0.1), r"negative_token_fraction must be .* \[0, 1\]"),
    "filter without entropies": (
        with_changes(negative_token_fraction=0.5, failures=torch.tensor([True, False])),
        "needs explicit entropies",
    ),
    "filter without failures": (
        with_changes(negative_token_fraction=0.5, entropies=torch.zeros(2, 2)),
        "needs explicit failures",
    ),
    "failures not bool": (
        with_changes(negative_token_fraction=0.5, entropies=torch.zeros(2, 2), failures=torch.tensor([1.0, 0.0])),
        "failures must be an explicit bool",
    ),
    "failures wrong shape": (
        with_changes(negative_token_fraction=0.5, entropies=torch.zeros(2, 2), failures=torch.tensor([True])),
        r"failures must have shape \[B\]",
    ),
    "entropies wrong shape": (
        with_changes(negative_token_fraction=0.5, entropies=torch.zeros(2, 3), failures=torch.tensor([True, False])),
        "shape mismatch: entropies",
    ),
    "entropies integer": (
        with_changes(
            negative_token_fraction=0.5,
            entropies=torch.zeros(2, 2, dtype=torch.long),
            failures=torch.tensor([True, False]),
        ),
        "entropies must be a floating-point",
    ),
    "entropies nan at a policy token": (
        with_changes(
            negative_token_fraction=0.5,
            entropies=torch.tensor([[math.nan, 0.0], [0.0, 0.0]]),
            failures=torch.tensor([True, False]),
        ),
        "entropies must be finite at policy tokens",
    ),
    "rewards on another device": (with_changes(rewards=torch.tensor([1.0, 0.0], device="meta")), "device"),
    "mask on another device": (with_changes(action_mask=torch.ones(2, 2, dtype=torch.bool, device="meta")), "device"),
    "behaviour on another device": (with_changes(behavior_log_probs=torch.zeros(2, 2, device="meta")), "device"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_a_value_error_naming_the_problem(case):
    inputs, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=message):
        flashreinforce_loss(**inputs)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(batch_size=1), "batch_size must be an integer >="),
        (dict(batch_size=2.0), "batch_size must be an integer"),
        (dict(advantages=torch.tensor([0.5])), r"advantages must have shape \[B\]"),
        (dict(advantages=torch.tensor([0.5, math.nan])), "advantages must be finite"),
        (dict(advantages=torch.tensor([1, 0])), "advantages must be a floating-point"),
    ],
)
def test_bad_slice_input_raises(changes, message):
    inputs = good_inputs()
    del inputs["rewards"]
    arguments = dict(inputs, advantages=torch.tensor([0.5, -0.5]), batch_size=4)
    arguments.update(changes)
    with pytest.raises(ValueError, match=message):
        flashreinforce_loss_from_advantages(**arguments)
