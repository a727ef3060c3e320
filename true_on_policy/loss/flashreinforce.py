"""FlashREINFORCE: the reference loss on one complete learner batch. Pure torch, no verl import.

One optimizer step per collected batch, no ratio clipping. Two mechanisms replace PPO's clip:

* the Sequence Trust Region gate: a trajectory is admitted iff the mean, over its policy tokens, of
  the Bernoulli KL between the behaviour and current probabilities of the sampled token is <= delta;
* an optional entropy filter: in a failed trajectory only the highest-entropy fraction of the policy
  tokens carries gradient.

For an admitted row i with T_i policy tokens and advantage A_i = R_i - mean_j R_j,

    loss = -(1/B) sum_i (A_i / T_i) sum_t active_it * stopgrad(exp(cur_it - beh_it)) * cur_it

so d loss / d cur_it = -(1/B) (A_i / T_i) ratio_it on active tokens and 0 elsewhere. B and T_i are
the ORIGINAL counts: a rejected row or a filtered token still counts in the denominators, which
keeps the step size independent of how many rows the gate rejects.

:func:`flashreinforce_loss` is the whole-batch reference. :func:`flashreinforce_loss_from_advantages`
is the same math for a slice of a batch (precomputed advantages, the full batch's size as the
denominator). Both validate their inputs (host reads) and run :func:`loss_core`, the arithmetic
alone, which the verl adapter calls per micro-batch without a host read (it validates once per batch
in the driver), so there is one implementation.
:func:`entropy_filter` is the filter alone: its keep decisions depend only on each row's own
entropies, failure flag and token count, so they can be computed where the entropies are (verl's
trainer) and handed to the loss as ``kept_tokens``, with the same result as passing the entropies.
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction

import torch

# Probabilities are clamped into the open unit interval so the Bernoulli KL stays finite when a
# sampled token had probability (numerically) 0 or 1 under either policy.
PROBABILITY_FLOOR = 1e-6
PROBABILITY_CEILING = 1.0 - 1e-6

STATS_KEYS = (
    "advantages",
    "sequence_kl",
    "admitted",
    "acceptance_rate",
    "sequence_kl_mean",
    "policy_tokens",
    "retained_tokens",
    "ratio_deviation",
)


def sequence_advantages(rewards: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A_i = R_i - mean_j R_j over the whole batch, without gradient, in ``dtype`` (default: the
    rewards' own floating dtype, or torch's default for integer rewards).

    The mean adds the rewards in ascending order, so it depends on the batch's rewards, not on the
    order of its rows (verl reorders the batch to balance data-parallel ranks: DP 1 and DP 2 get the
    same baseline bits). Validates, then computes with :func:`masked_sequence_advantages` (every row
    a trajectory), the arithmetic verl's ``flashreinforce`` advantage estimator runs.
    """
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D tensor [B], got shape {tuple(rewards.shape)}")
    if rewards.dtype == torch.bool or rewards.is_complex():
        raise ValueError(f"rewards must be a real-valued (float or integer) tensor, got dtype {rewards.dtype}")
    with torch.no_grad():
        rewards = rewards.detach()
        if dtype is not None:
            rewards = rewards.to(dtype)
        elif not rewards.is_floating_point():
            rewards = rewards.to(torch.get_default_dtype())
        if not torch.isfinite(rewards).all():
            bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
            raise ValueError(f"rewards must be finite; non-finite at rows {bad}")
        return masked_sequence_advantages(rewards, torch.ones_like(rewards, dtype=torch.bool))


def masked_sequence_advantages(rewards: torch.Tensor, trajectories: torch.Tensor) -> torch.Tensor:
    """A_i = R_i - (mean of R_j over the rows j that are ``trajectories``) for those rows, 0 elsewhere.

    No validation and no host read (no ``.item()``, no data-dependent shape): the caller validated
    the rewards, and a batch without any trajectory gives NaN, which the caller must have refused.
    The mean adds the values in ascending order one after another (a cumulative sum of the sorted
    values): the row order changes no bit of it, and rows that are no trajectory -- verl's padding
    rows, wherever they sit -- enter as zeros, exact no-ops of that sum.
    """
    with torch.no_grad():
        zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
        total = torch.cumsum(torch.sort(torch.where(trajectories, rewards, zero)).values, dim=0)[-1]
        mean = total / trajectories.sum().to(rewards.dtype)
        return torch.where(trajectories, rewards - mean, zero)


def flashreinforce_loss(
    log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    delta: float = 3e-3,
    negative_token_fraction: float = 1.0,
    entropies: torch.Tensor | None = None,
    failures: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """FlashREINFORCE loss of one complete learner batch.

    Args:
        log_probs: [B, T] current log-probs of the sampled tokens (carries the gradient).
        behavior_log_probs: [B, T] log-probs the rollout engine recorded when it sampled them.
        rewards: [B] sequence rewards; the baseline is their batch mean.
        action_mask: [B, T] bool, True at policy tokens; every row needs at least one.
        delta: gate threshold on the mean Bernoulli KL of a row (inclusive; ``inf`` disables it).
        negative_token_fraction: q in [0, 1]; q < 1 keeps only the ceil(q * T_i) highest-entropy
            policy tokens of each failed row (needs ``entropies`` and ``failures``).
        entropies: [B, T] float token entropies of the behaviour policy, for the filter.
        failures: [B] bool, True for failed trajectories, for the filter.

    Returns:
        ``(loss, stats)``; stats are detached: advantages [B], sequence_kl [B], admitted [B] bool,
        acceptance_rate (scalar), policy_tokens [B], retained_tokens [B] (tokens that carry
        gradient: kept by the filter in an admitted row), ratio_deviation (scalar: mean |ratio - 1|
        over those tokens, 0 when there are none).
    """
    batch_size, _ = _check_log_prob_pair(log_probs, behavior_log_probs)
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if tuple(rewards.shape) != (batch_size,):
        raise ValueError(f"rewards must have shape [B] = ({batch_size},), got {tuple(rewards.shape)}")
    _check_device("rewards", rewards, log_probs.device)
    advantages = sequence_advantages(rewards, dtype=_compute_dtype(log_probs, behavior_log_probs))
    return flashreinforce_loss_from_advantages(
        log_probs,
        behavior_log_probs,
        advantages,
        action_mask,
        batch_size=batch_size,
        delta=delta,
        negative_token_fraction=negative_token_fraction,
        entropies=entropies,
        failures=failures,
    )


def flashreinforce_loss_from_advantages(
    log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    batch_size: int,
    delta: float = 3e-3,
    negative_token_fraction: float = 1.0,
    entropies: torch.Tensor | None = None,
    failures: torch.Tensor | None = None,
    kept_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """FlashREINFORCE loss of some rows of a batch, given their advantages.

    ``batch_size`` is the number of rows of the WHOLE learner batch (the 1/B of the mean). Summing
    this loss over disjoint slices that cover a batch, each with that batch's size and the slice's
    rows of the batch-wide advantages, gives exactly :func:`flashreinforce_loss` of the batch:
    every term depends only on its own row. Arguments are otherwise as in
    :func:`flashreinforce_loss`; ``advantages`` is [rows] and is used without gradient.

    ``kept_tokens`` ([rows, T] bool, a subset of ``action_mask``) are the entropy filter's decisions
    computed beforehand, as :func:`entropy_filter` returns them; they replace
    ``negative_token_fraction``/``entropies``/``failures`` (passing both is an error). The
    denominators stay the original ``batch_size`` and T_i = ``action_mask.sum(-1)`` either way, so
    ``kept_tokens=entropy_filter(action_mask, entropies, failures, q)`` gives exactly the loss of
    ``negative_token_fraction=q, entropies=entropies, failures=failures``.
    """
    rows, length = _check_log_prob_pair(log_probs, behavior_log_probs)
    device = log_probs.device
    compute_dtype = _compute_dtype(log_probs, behavior_log_probs)

    _check_mask(action_mask, rows, length, device)
    _check_advantages(advantages, rows, device)
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < rows:
        raise ValueError(
            f"batch_size must be an integer >= the number of rows given ({rows}): it is the size of the whole "
            f"learner batch these rows belong to; got {batch_size!r}"
        )
    _check_delta(delta)
    fraction = _check_fraction(negative_token_fraction)
    filter_requested = fraction < 1.0
    if kept_tokens is not None:
        if filter_requested or entropies is not None or failures is not None:
            raise ValueError(
                "pass the entropy filter either as kept_tokens (its precomputed decisions) or as "
                "negative_token_fraction < 1 with entropies and failures, not both"
            )
        _check_kept_tokens(kept_tokens, action_mask)
    _check_filter_inputs(entropies, failures, rows, length, device, required=filter_requested)

    policy_tokens = action_mask.sum(dim=-1)
    if not bool((policy_tokens > 0).all()):
        empty = torch.nonzero(policy_tokens == 0).flatten().tolist()
        raise ValueError(f"every row needs at least one policy token in action_mask; rows {empty} have none")
    with torch.no_grad():
        _check_policy_log_probs(torch.where(action_mask, log_probs.detach(), 0), action_mask, "log_probs")
        _check_policy_log_probs(torch.where(action_mask, behavior_log_probs.detach(), 0), action_mask, "behavior_log_probs")
        if entropies is not None:
            _check_policy_entropies(entropies, action_mask)
        if kept_tokens is None and filter_requested:
            kept_tokens = _entropy_filter(action_mask, entropies, failures, fraction, policy_tokens)

    loss, stats, non_finite = loss_core(
        log_probs, behavior_log_probs, advantages, action_mask, batch_size=batch_size, delta=delta, kept_tokens=kept_tokens
    )
    if bool(non_finite.any()):
        where = torch.nonzero(non_finite)[:5].tolist()
        raise FloatingPointError(
            f"importance ratio exp(log_probs - behavior_log_probs) is not finite on active tokens "
            f"(first [row, position]: {where}); the log-ratio overflows {compute_dtype}"
        )
    return loss, stats


def loss_core(
    log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    batch_size: int,
    delta: float,
    kept_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The arithmetic of :func:`flashreinforce_loss_from_advantages`, without validation and without
    a host read: tensors in, tensors out (what verl's per-micro-batch loss runs; the caller validated
    the inputs once per batch). Returns ``(loss, stats, non_finite)``: ``non_finite`` [rows, T] marks
    active tokens whose ratio is not finite (the caller raises on it).

    A row without policy tokens (verl's synthetic padding) contributes nothing and is no row of the
    stats' means; with no row at all, the stats are 0.
    """
    device = log_probs.device
    compute_dtype = _compute_dtype(log_probs, behavior_log_probs)
    zero = torch.zeros((), dtype=compute_dtype, device=device)
    policy_tokens = action_mask.sum(dim=-1)
    rows = policy_tokens > 0
    # A row without policy tokens divides by 1: its terms are all zero anyway.
    row_tokens = policy_tokens.clamp(min=1).to(compute_dtype)

    # Values at masked-out positions may be anything (padding, NaN, inf); torch.where selects them
    # away before any arithmetic, so they reach neither the loss nor the gradient.
    current = torch.where(action_mask, log_probs.to(compute_dtype), zero)

    with torch.no_grad():
        current_values = current.detach()
        behaviour = torch.where(action_mask, behavior_log_probs.detach().to(compute_dtype), zero)

        sequence_kl = _sequence_bernoulli_kl(behaviour, current_values, action_mask, row_tokens)
        admitted = (sequence_kl <= delta) & rows  # inclusive; delta = inf admits every row

        kept = action_mask if kept_tokens is None else kept_tokens
        active = kept & admitted.unsqueeze(-1)

        # The ratio is exponentiated only where it is used: a rejected row or a filtered token may
        # carry an enormous log-ratio, and it must neither overflow nor raise.
        log_ratio = torch.where(active, current_values - behaviour, zero)
        ratio = torch.exp(log_ratio)
        non_finite = active & ~torch.isfinite(ratio)

        row_advantages = advantages.detach().to(compute_dtype)
        # d loss / d cur_it = -(1/B) * per_token_weight_it: (A_i / T_i) * stopgrad(ratio) where active.
        per_token_weight = (row_advantages / row_tokens).unsqueeze(-1) * ratio
        per_token_weight = torch.where(active, per_token_weight, zero)

    # Per row, then over rows in order (a cumulative sum: torch's CPU cumsum accumulates sequentially),
    # so a row that contributes zero -- verl's padding row, wherever it sits -- changes no bit of the
    # loss without being selected away (selection is a data-dependent shape: a host sync on a device).
    loss = -torch.cumsum((per_token_weight * current).sum(dim=-1), dim=0)[-1] / batch_size

    with torch.no_grad():
        retained_tokens = active.sum(dim=-1)
        retained_total = retained_tokens.sum()
        ratio_deviation = torch.where(active, (ratio - 1.0).abs(), zero).sum()
        ratio_deviation = ratio_deviation / retained_total.clamp(min=1).to(compute_dtype)
        row_count = rows.sum().clamp(min=1).to(compute_dtype)
        stats = {
            "advantages": row_advantages,
            "sequence_kl": sequence_kl,
            "admitted": admitted,
            "acceptance_rate": admitted.sum().to(compute_dtype) / row_count,
            "sequence_kl_mean": torch.where(rows, sequence_kl, zero).sum() / row_count,
            "policy_tokens": policy_tokens,
            "retained_tokens": retained_tokens,
            "ratio_deviation": ratio_deviation,
        }
    return loss, stats, non_finite


# --- the two mechanisms ---------------------------------------------------------------------------


def entropy_filter(
    action_mask: torch.Tensor,
    entropies: torch.Tensor,
    failures: torch.Tensor,
    negative_token_fraction: float,
) -> torch.Tensor:
    """The entropy filter's keep decisions, [B, T] bool: every policy token of a successful row; in
    a failed row the ceil(q * T_i) highest-entropy policy tokens, ties going to the earlier position
    (q = ``negative_token_fraction``, T_i = the row's policy tokens). Never keeps a masked position.

    Per row: a row's decisions depend on its own entropies, failure flag and T_i only, so any split
    of a batch into rows gives the same decisions. A row without policy tokens (verl's synthetic
    padding) keeps nothing. The result is what :func:`flashreinforce_loss_from_advantages` accepts
    as ``kept_tokens``.

    Args:
        action_mask: [B, T] bool, True at policy tokens.
        entropies: [B, T] float token entropies of the behaviour policy; finite at policy tokens.
        failures: [B] bool, True for failed trajectories.
        negative_token_fraction: q in [0, 1]; 1 keeps every policy token.
    """
    if not isinstance(action_mask, torch.Tensor) or action_mask.dim() != 2:
        found = tuple(action_mask.shape) if isinstance(action_mask, torch.Tensor) else type(action_mask).__name__
        raise ValueError(f"action_mask must be a 2-D [B, T] tensor, got {found}")
    rows, length = action_mask.shape
    _check_mask(action_mask, rows, length, action_mask.device)
    fraction = _check_fraction(negative_token_fraction)
    _check_filter_inputs(entropies, failures, rows, length, action_mask.device, required=True)
    _check_policy_entropies(entropies, action_mask)
    with torch.no_grad():
        policy_tokens = action_mask.sum(dim=-1)
        return _entropy_filter(action_mask, entropies.detach(), failures, fraction, policy_tokens)


def kept_token_count(negative_token_fraction: float, policy_tokens: int) -> int:
    """ceil(q * T) in exact arithmetic on the decimal the user wrote: the tokens a failed row keeps."""
    return _ceil_fraction(_check_fraction(negative_token_fraction), int(policy_tokens))


def _ceil_fraction(fraction: float, count: int) -> int:
    # ceil on the decimal the user wrote, in exact arithmetic: the float product 0.28 * 25 is
    # 7.000000000000001 and would keep one token too many.
    return math.ceil(Fraction(repr(fraction)) * count)


def _sequence_bernoulli_kl(
    behaviour: torch.Tensor, current: torch.Tensor, action_mask: torch.Tensor, policy_tokens: torch.Tensor
) -> torch.Tensor:
    """D_i = mean over policy tokens of KL(Bernoulli(p) || Bernoulli(q)), p behaviour, q current."""
    p = behaviour.exp().clamp(PROBABILITY_FLOOR, PROBABILITY_CEILING)
    q = current.exp().clamp(PROBABILITY_FLOOR, PROBABILITY_CEILING)
    token_kl = p * (p.log() - q.log()) + (1.0 - p) * ((1.0 - p).log() - (1.0 - q).log())
    token_kl = torch.where(action_mask, token_kl, torch.zeros((), dtype=token_kl.dtype, device=token_kl.device))
    # Each term is >= 0 in exact arithmetic; the clamp only removes rounding below zero.
    return (token_kl.sum(dim=-1) / policy_tokens.to(token_kl.dtype)).clamp(min=0.0)


def _entropy_filter(
    action_mask: torch.Tensor,
    entropies: torch.Tensor,
    failures: torch.Tensor,
    fraction: float,
    policy_tokens: torch.Tensor,
) -> torch.Tensor:
    """Tokens kept by the filter: all policy tokens of successful rows; in each failed row the
    ceil(fraction * T_i) highest-entropy policy tokens, ties going to the earlier position."""
    rows, length = action_mask.shape
    lowest = torch.full((), -math.inf, dtype=entropies.dtype, device=entropies.device)
    ranking = torch.where(action_mask, entropies, lowest)
    # A stable descending sort keeps equal entropies in position order, so the earlier one ranks first;
    # masked positions (-inf) rank after every policy token.
    order = torch.sort(ranking, dim=-1, descending=True, stable=True).indices
    positions = torch.arange(length, device=action_mask.device).expand(rows, length)
    rank = torch.empty_like(order).scatter_(1, order, positions)
    keep_counts = torch.tensor(
        [_ceil_fraction(fraction, count) for count in policy_tokens.tolist()], device=action_mask.device
    )
    kept_in_failed_row = action_mask & (rank < keep_counts.unsqueeze(-1))
    return torch.where(failures.unsqueeze(-1), kept_in_failed_row, action_mask)


# --- validation -----------------------------------------------------------------------------------


def _compute_dtype(log_probs: torch.Tensor, behavior_log_probs: torch.Tensor) -> torch.dtype:
    # Half precision is promoted to float32 for the KL and the ratio; float64 stays float64.
    return torch.promote_types(torch.promote_types(log_probs.dtype, behavior_log_probs.dtype), torch.float32)


def _check_log_prob_pair(log_probs: torch.Tensor, behavior_log_probs: torch.Tensor) -> tuple[int, int]:
    for name, tensor in (("log_probs", log_probs), ("behavior_log_probs", behavior_log_probs)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 2:
            raise ValueError(f"{name} must be 2-D [B, T], got shape {tuple(tensor.shape)}")
        if tensor.numel() == 0:
            raise ValueError(f"{name} must not be empty, got shape {tuple(tensor.shape)}")
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
    if log_probs.shape != behavior_log_probs.shape:
        raise ValueError(
            f"shape mismatch: log_probs {tuple(log_probs.shape)} vs "
            f"behavior_log_probs {tuple(behavior_log_probs.shape)}"
        )
    _check_device("behavior_log_probs", behavior_log_probs, log_probs.device)
    return log_probs.shape[0], log_probs.shape[1]


def _check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but log_probs is on {device}; all tensors must share a device")


def _check_mask(action_mask: torch.Tensor, rows: int, length: int, device: torch.device) -> None:
    if not isinstance(action_mask, torch.Tensor):
        raise ValueError(f"action_mask must be a torch.Tensor, got {type(action_mask).__name__}")
    if action_mask.dtype != torch.bool:
        raise ValueError(f"action_mask must be a bool tensor, got dtype {action_mask.dtype}")
    if tuple(action_mask.shape) != (rows, length):
        raise ValueError(f"shape mismatch: action_mask {tuple(action_mask.shape)} vs log_probs {(rows, length)}")
    _check_device("action_mask", action_mask, device)


def _check_advantages(advantages: torch.Tensor, rows: int, device: torch.device) -> None:
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"advantages must be a torch.Tensor, got {type(advantages).__name__}")
    if tuple(advantages.shape) != (rows,):
        raise ValueError(f"advantages must have shape [B] = ({rows},), got {tuple(advantages.shape)}")
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be a floating-point tensor, got dtype {advantages.dtype}")
    _check_device("advantages", advantages, device)
    if not bool(torch.isfinite(advantages).all()):
        raise ValueError("advantages must be finite")


def _check_delta(delta: float) -> None:
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or math.isnan(delta) or delta < 0:
        raise ValueError(f"delta must be a number >= 0 (inf disables the gate), got {delta!r}")


def _check_fraction(fraction: float) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"negative_token_fraction must be a number in [0, 1], got {fraction!r}")
    return float(fraction)


def _check_kept_tokens(kept_tokens: torch.Tensor, action_mask: torch.Tensor) -> None:
    if not isinstance(kept_tokens, torch.Tensor) or kept_tokens.dtype != torch.bool:
        found = getattr(kept_tokens, "dtype", type(kept_tokens).__name__)
        raise ValueError(f"kept_tokens must be a bool tensor [B, T], got {found}")
    if kept_tokens.shape != action_mask.shape:
        raise ValueError(
            f"shape mismatch: kept_tokens {tuple(kept_tokens.shape)} vs action_mask {tuple(action_mask.shape)}"
        )
    _check_device("kept_tokens", kept_tokens, action_mask.device)
    outside = kept_tokens & ~action_mask
    if bool(outside.any()):
        where = torch.nonzero(outside)[:5].tolist()
        raise ValueError(f"kept_tokens must be a subset of action_mask; kept masked [row, position]: {where}")


def _check_filter_inputs(
    entropies: torch.Tensor | None,
    failures: torch.Tensor | None,
    rows: int,
    length: int,
    device: torch.device,
    *,
    required: bool,
) -> None:
    if required and (entropies is None or failures is None):
        missing = [name for name, value in (("entropies", entropies), ("failures", failures)) if value is None]
        raise ValueError(
            f"negative_token_fraction < 1 requests the entropy filter, which needs explicit {' and '.join(missing)}"
        )
    if entropies is not None:
        if not isinstance(entropies, torch.Tensor) or not entropies.is_floating_point():
            found = getattr(entropies, "dtype", type(entropies).__name__)
            raise ValueError(f"entropies must be a floating-point tensor, got {found}")
        if tuple(entropies.shape) != (rows, length):
            raise ValueError(f"shape mismatch: entropies {tuple(entropies.shape)} vs log_probs {(rows, length)}")
        _check_device("entropies", entropies, device)
    if failures is not None:
        if not isinstance(failures, torch.Tensor) or failures.dtype != torch.bool:
            found = getattr(failures, "dtype", type(failures).__name__)
            raise ValueError(f"failures must be an explicit bool tensor [B], got {found}")
        if tuple(failures.shape) != (rows,):
            raise ValueError(f"failures must have shape [B] = ({rows},), got {tuple(failures.shape)}")
        _check_device("failures", failures, device)


def _check_policy_log_probs(values: torch.Tensor, action_mask: torch.Tensor, name: str) -> None:
    invalid = action_mask & ~(torch.isfinite(values) & (values <= 0))
    if bool(invalid.any()):
        where = torch.nonzero(invalid)[:5].tolist()
        raise ValueError(f"{name} must be finite and <= 0 at policy tokens; first bad [row, position]: {where}")


def _check_policy_entropies(entropies: torch.Tensor, action_mask: torch.Tensor) -> None:
    invalid = action_mask & ~torch.isfinite(entropies.detach())
    if bool(invalid.any()):
        where = torch.nonzero(invalid)[:5].tolist()
        raise ValueError(f"entropies must be finite at policy tokens; first bad [row, position]: {where}")
