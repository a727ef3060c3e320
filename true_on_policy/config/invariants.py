"""FlashREINFORCE's config invariants, checked on the resolved Hydra config before Ray starts.

They apply when the config trains with FlashREINFORCE (``Algorithm.flashreinforce``: its loss or its
advantage estimator is ``flashreinforce``); a GRPO, GSPO or DAPO config with the true-on-policy flag
is not held to them.

FlashREINFORCE is one optimizer step on one freshly collected batch whose behaviour log-probs the
rollout engine recorded, then the batch is discarded. Several of verl's knobs silently break that
contract (a second epoch or mini-batch trains on stale data without any clip; a KL term or a
truncated sampler changes what the behaviour probabilities mean), so each is checked here, by a
short stable name that ``true_on_policy.relax_invariants=[<name>]`` can waive on purpose.

They check the keys as found (:data:`INVARIANT_KEYS`, read by
:func:`true_on_policy.config.launch.read_algorithm`: key -> value, :data:`MISSING` when absent).
Pure: no verl or omegaconf import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

RELAX_KEY = "true_on_policy.relax_invariants"
SAMPLE_MEAN = "seq-mean-token-mean"
FLASHREINFORCE = "flashreinforce"
LOSS_MODE_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"
ADV_ESTIMATOR_KEY = "algorithm.adv_estimator"


class _Missing:
    """The found value of a key that is absent from (or unresolvable in) the config."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()


@dataclasses.dataclass(frozen=True)
class Violation:
    """One config key whose value breaks the invariant ``name``."""

    name: str
    key: str
    found: Any
    expected: str

    def __str__(self) -> str:
        return (
            f"[{self.name}] {self.key} = {self.found!r}, expected {self.expected} "
            f"(to relax on purpose: {RELAX_KEY}=[{self.name}])"
        )


@dataclasses.dataclass(frozen=True)
class _Requirement:
    key: str
    expected: str
    holds: Callable[[Any], bool]
    # An absent key satisfies the requirement when the default it stands for is the required one.
    missing_ok: bool = False


def _is_plain_int(value: Any) -> bool:
    # bool is an int in Python; True must not pass for 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int(value: Any, target: int) -> bool:
    return _is_plain_int(value) and value == target


def _is_number(value: Any, target: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == target


def _is_exactly(target: Any) -> Callable[[Any], bool]:
    return lambda value: type(value) is type(target) and value == target


TRAIN_BATCH_SIZE_KEY = "data.train_batch_size"


def _same_as_train_batch_size(found: Mapping[str, Any]) -> _Requirement:
    train_batch_size = found.get(TRAIN_BATCH_SIZE_KEY, MISSING)
    return _Requirement(
        key="actor_rollout_ref.actor.ppo_mini_batch_size",
        expected=f"data.train_batch_size ({train_batch_size!r}): one optimizer step per collected batch",
        holds=lambda value: _is_plain_int(train_batch_size) and _is_int(value, train_batch_size),
    )


# name -> function of the found keys giving the requirements; most are constant, one compares two keys.
INVARIANTS: dict[str, Callable[[Any], list[_Requirement]]] = {
    "single_rollout": lambda config: [
        _Requirement(
            "actor_rollout_ref.rollout.n",
            "1 (one sample per prompt; the baseline is the batch mean)",
            lambda v: _is_int(v, 1),
        ),
    ],
    "single_epoch": lambda config: [
        _Requirement(
            "actor_rollout_ref.actor.ppo_epochs",
            "1 (each batch is trained on once, then discarded)",
            lambda v: _is_int(v, 1),
        ),
    ],
    "one_step_per_batch": lambda config: [_same_as_train_batch_size(config)],
    "no_kl": lambda config: [
        _Requirement("actor_rollout_ref.actor.use_kl_loss", "false (no KL loss term)", _is_exactly(False)),
        _Requirement("algorithm.use_kl_in_reward", "false (no KL penalty in the reward)", _is_exactly(False)),
    ],
    "no_entropy_bonus": lambda config: [
        # verl's ppo_loss subtracts entropy_coeff * entropy from the policy loss: a second objective.
        _Requirement(
            "actor_rollout_ref.actor.entropy_coeff", "0 (no entropy bonus term)", lambda v: _is_number(v, 0)
        ),
    ],
    "behaviour_log_probs": lambda config: [
        _Requirement(
            "actor_rollout_ref.rollout.calculate_log_probs",
            "true (the gate and the ratio need the log-probs the rollout engine sampled with)",
            _is_exactly(True),
        ),
        # The hook that hands those log-probs to the loss wraps the v1 trainer only; the legacy
        # trainer would feed the gate recomputed log-probs without a word.
        _Requirement("trainer.use_v1", "true (verl's v1 trainer carries the behaviour log-probs)", _is_exactly(True)),
    ],
    "full_support_sampling": lambda config: [
        # Truncated sampling makes the recorded log-probs those of a different distribution than
        # the one the learner differentiates.
        _Requirement("actor_rollout_ref.rollout.top_p", "1 (no nucleus truncation)", lambda v: _is_number(v, 1)),
        # verl: -1 disables top-k for vLLM/SGLang, 0 for the HF rollout (trainer/config/rollout/rollout.yaml).
        _Requirement(
            "actor_rollout_ref.rollout.top_k",
            "-1 or 0 (top-k disabled)",
            lambda v: _is_int(v, -1) or _is_int(v, 0),
        ),
        _Requirement(
            "actor_rollout_ref.rollout.do_sample", "true (sampling, not greedy decoding)", _is_exactly(True)
        ),
    ],
    "sample_mean_aggregation": lambda config: [
        _Requirement(
            "actor_rollout_ref.actor.loss_agg_mode",
            f"'{SAMPLE_MEAN}' (FlashREINFORCE averages tokens within a trajectory, then trajectories)",
            lambda v: v == SAMPLE_MEAN,
        ),
    ],
    "no_rollout_correction": lambda config: [
        # Importance weights or rejection masks from verl's rollout correction would change the
        # loss (weights) or the per-trajectory token counts T_i (masks) behind the gate's back.
        _Requirement(
            "algorithm.rollout_correction.rollout_is",
            "null (the gate replaces importance weighting)",
            lambda v: v is None,
            missing_ok=True,
        ),
        _Requirement(
            "algorithm.rollout_correction.rollout_rs",
            "null (rejection masks would change T_i)",
            lambda v: v is None,
            missing_ok=True,
        ),
    ],
    "loss_mode": lambda config: [
        _Requirement(LOSS_MODE_KEY, f"'{FLASHREINFORCE}'", lambda v: v == FLASHREINFORCE),
    ],
    "adv_estimator": lambda config: [
        _Requirement(ADV_ESTIMATOR_KEY, f"'{FLASHREINFORCE}' (A_i = R_i - batch mean)", lambda v: v == FLASHREINFORCE),
    ],
}

INVARIANT_NAMES = tuple(INVARIANTS)
# Every key the invariants read.
INVARIANT_KEYS = (TRAIN_BATCH_SIZE_KEY, *(r.key for requirements_of in INVARIANTS.values() for r in requirements_of({})))


def check_invariants(found: Mapping[str, Any], relax: Iterable[str] = ()) -> list[Violation]:
    """Every violated, unrelaxed invariant, one Violation per offending key; [] when all hold.

    ``found``: key -> value for every key of :data:`INVARIANT_KEYS` (:data:`MISSING` when absent)."""
    relaxed = _validated_relax(relax)
    violations = []
    for name, requirements_of in INVARIANTS.items():
        if name in relaxed:
            continue
        for requirement in requirements_of(found):
            value = found[requirement.key]
            if value is MISSING and requirement.missing_ok:
                continue
            if value is MISSING or not requirement.holds(value):
                violations.append(Violation(name=name, key=requirement.key, found=value, expected=requirement.expected))
    return violations


def validate_relax(relax: Iterable[str]) -> frozenset[str]:
    """The relaxed invariant names; a string or an unknown name is a ValueError naming it."""
    return _validated_relax(relax)


def _validated_relax(relax: Iterable[str]) -> frozenset[str]:
    if isinstance(relax, str):
        raise ValueError(f"{RELAX_KEY} must be a list of invariant names, got the string {relax!r}")
    names = list(relax or ())
    unknown = sorted(str(name) for name in names if name not in INVARIANTS)
    if unknown:
        raise ValueError(f"unknown invariant name(s) in {RELAX_KEY}: {unknown}; known: {list(INVARIANT_NAMES)}")
    return frozenset(names)


def refusals(algorithm: Any, settings: Any, notes: list[str]) -> list[str]:
    """The refusals for a launch's :class:`~true_on_policy.config.launch.Algorithm` under its settings:
    FlashREINFORCE's invariants when it trains; its settings left at their defaults when it does not
    (a waiver that has no effect is noted in ``notes``)."""
    try:
        if algorithm.flashreinforce:
            return [str(v) for v in check_invariants(algorithm.found, relax=settings.relax_invariants)]
        validate_relax(settings.relax_invariants)
    except ValueError as error:
        return [f"bad config value: {error}"]
    if settings.relax_invariants:
        notes.append(
            f"true_on_policy.relax_invariants={list(settings.relax_invariants)} has no effect: the FlashREINFORCE "
            "invariants apply when actor_rollout_ref.actor.policy_loss.loss_mode or algorithm.adv_estimator is flashreinforce"
        )
    if settings.negative_token_fraction < 1.0:
        return [
            f"bad config value: true_on_policy.negative_token_fraction={settings.negative_token_fraction!r} is "
            "FlashREINFORCE's entropy filter (its keep mask travels in rollout_is_weights, which another loss reads as "
            "importance weights); with loss_mode "
            f"{algorithm.found[LOSS_MODE_KEY]!r} leave it at 1.0"
        ]
    return []
