"""FlashREINFORCE's config invariants on verl's real generated trainer config.

The config is verl 0.9.1's own ``trainer/config/_generated_ppo_trainer.yaml`` from the installed
package, located with ``importlib.util.find_spec`` so the test reads the shipped file without
running verl's ``__init__`` (which loads every plugin).
"""

import copy
import functools
import importlib.util
import pathlib

import pytest
from omegaconf import OmegaConf

from true_on_policy.config import invariants
from true_on_policy.config.invariants import INVARIANT_NAMES, MISSING
from true_on_policy.config.launch import read_algorithm

from contract_helpers import enforce_invariants


def check_invariants(config, relax=()):
    return invariants.check_invariants(read_algorithm(config).found, relax)


@functools.cache
def _loaded_verl_config():
    spec = importlib.util.find_spec("verl")
    root = pathlib.Path(next(iter(spec.submodule_search_locations)))
    return OmegaConf.load(root / "trainer" / "config" / "_generated_ppo_trainer.yaml")


def verl_generated_config():
    return copy.deepcopy(_loaded_verl_config())


@functools.cache
def _flashreinforce_config():
    config = verl_generated_config()
    overrides = OmegaConf.from_dotlist(
        [
            "data.train_batch_size=16",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "actor_rollout_ref.actor.ppo_epochs=1",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
            "actor_rollout_ref.actor.policy_loss.loss_mode=flashreinforce",
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "actor_rollout_ref.rollout.top_p=1.0",
            "actor_rollout_ref.rollout.top_k=-1",
            "algorithm.adv_estimator=flashreinforce",
            "algorithm.use_kl_in_reward=false",
        ]
    )
    return OmegaConf.merge(config, overrides)


def flashreinforce_config():
    return copy.deepcopy(_flashreinforce_config())


def with_value(key, value):
    config = flashreinforce_config()
    OmegaConf.update(config, key, value, merge=False)
    return config


def test_the_flashreinforce_config_satisfies_every_invariant():
    config = flashreinforce_config()
    assert check_invariants(config) == []
    enforce_invariants(config)


def test_a_plain_resolved_mapping_works_too():
    config = OmegaConf.to_container(flashreinforce_config(), resolve=True)
    assert check_invariants(config) == []
    config["actor_rollout_ref"]["rollout"]["n"] = 4
    assert [violation.name for violation in check_invariants(config)] == ["single_rollout"]


def test_verl_defaults_are_reported():
    names = {violation.name for violation in check_invariants(verl_generated_config())}
    # verl's default PPO: mini-batch 256 of a 1024 batch, token-mean, vanilla loss, GAE.
    assert names == {"one_step_per_batch", "sample_mean_aggregation", "loss_mode", "adv_estimator"}


VIOLATIONS = [
    ("single_rollout", "actor_rollout_ref.rollout.n", 8),
    ("single_rollout", "actor_rollout_ref.rollout.n", True),  # a bool is not the integer 1
    ("single_epoch", "actor_rollout_ref.actor.ppo_epochs", 2),
    ("one_step_per_batch", "actor_rollout_ref.actor.ppo_mini_batch_size", 8),
    ("no_kl", "actor_rollout_ref.actor.use_kl_loss", True),
    ("no_kl", "algorithm.use_kl_in_reward", True),
    ("no_entropy_bonus", "actor_rollout_ref.actor.entropy_coeff", 0.01),
    ("behaviour_log_probs", "actor_rollout_ref.rollout.calculate_log_probs", False),
    ("behaviour_log_probs", "trainer.use_v1", False),
    ("full_support_sampling", "actor_rollout_ref.rollout.top_p", 0.95),
    ("full_support_sampling", "actor_rollout_ref.rollout.top_k", 50),
    ("full_support_sampling", "actor_rollout_ref.rollout.do_sample", False),
    ("sample_mean_aggregation", "actor_rollout_ref.actor.loss_agg_mode", "token-mean"),
    ("no_rollout_correction", "algorithm.rollout_correction.rollout_is", "token"),
    ("no_rollout_correction", "algorithm.rollout_correction.rollout_rs", "token_k1"),
    ("loss_mode", "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla"),
    ("adv_estimator", "algorithm.adv_estimator", "grpo"),
]


@pytest.mark.parametrize(("name", "key", "value"), VIOLATIONS)
def test_each_invariant_is_violated_and_relaxed_by_name(name, key, value):
    config = with_value(key, value)

    violations = check_invariants(config)
    assert len(violations) == 1
    (violation,) = violations
    assert (violation.name, violation.key, violation.found) == (name, key, value)
    assert violation.expected

    with pytest.raises(ValueError) as raised:
        enforce_invariants(config)
    message = str(raised.value)
    assert key in message and violation.expected in message
    assert f"true_on_policy.relax_invariants=[{name}]" in message

    assert check_invariants(config, relax=[name]) == []
    enforce_invariants(config, relax=(name,))


def test_the_mini_batch_must_equal_the_train_batch_not_just_divide_it():
    config = with_value("data.train_batch_size", 32)
    (violation,) = check_invariants(config)
    assert violation.name == "one_step_per_batch" and violation.found == 16
    assert "data.train_batch_size (32)" in violation.expected


@pytest.mark.parametrize("top_k", [-1, 0])
def test_both_of_verls_top_k_off_values_are_accepted(top_k):
    assert check_invariants(with_value("actor_rollout_ref.rollout.top_k", top_k)) == []


def test_top_p_as_integer_one_is_accepted():
    assert check_invariants(with_value("actor_rollout_ref.rollout.top_p", 1)) == []


def test_enforce_lists_every_violation():
    config = with_value("actor_rollout_ref.rollout.n", 4)
    OmegaConf.update(config, "actor_rollout_ref.actor.ppo_epochs", 3)
    OmegaConf.update(config, "algorithm.use_kl_in_reward", True)
    with pytest.raises(ValueError) as raised:
        enforce_invariants(config)
    message = str(raised.value)
    assert "3 FlashREINFORCE invariant(s)" in message
    for name in ("single_rollout", "single_epoch", "no_kl"):
        assert f"relax_invariants=[{name}]" in message
    # relaxing one leaves the others
    assert {v.name for v in check_invariants(config, relax=["no_kl"])} == {"single_rollout", "single_epoch"}


def test_a_missing_key_is_a_violation():
    config = OmegaConf.to_container(flashreinforce_config(), resolve=True)
    del config["actor_rollout_ref"]["rollout"]["calculate_log_probs"]
    (violation,) = check_invariants(config)
    assert violation.name == "behaviour_log_probs" and violation.found is MISSING
    assert "<missing>" in str(violation)


def test_a_mandatory_missing_value_is_a_violation():
    config = with_value("actor_rollout_ref.rollout.n", "???")
    (violation,) = check_invariants(config)
    assert violation.name == "single_rollout" and violation.found is MISSING


def test_an_absent_rollout_correction_section_means_no_correction():
    config = OmegaConf.to_container(flashreinforce_config(), resolve=True)
    del config["algorithm"]["rollout_correction"]
    assert check_invariants(config) == []


def test_unknown_relax_names_are_an_error():
    with pytest.raises(ValueError, match=r"unknown invariant name\(s\).*'no_such_thing'"):
        check_invariants(flashreinforce_config(), relax=["no_kl", "no_such_thing"])
    with pytest.raises(ValueError, match="must be a list of invariant names"):
        enforce_invariants(flashreinforce_config(), relax="no_kl")


def test_every_invariant_has_a_violation_case():
    assert {name for name, _, _ in VIOLATIONS} == set(INVARIANT_NAMES)
