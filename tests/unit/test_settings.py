"""The ``true_on_policy:`` section: one schema (the Settings dataclass), in every shipped config,
every key overridable without ``+``, a bad value refused naming key and value (exit 2 from the real
launch: tests/engine/test_settings_engine.py), and no defaults when nothing was exported."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from true_on_policy.cli.check import compose_config
from true_on_policy.config import settings
from true_on_policy.config.settings import ConfigError, Settings, SettingsNotExported

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
SHIPPED = sorted(path.stem for path in CONFIGS.glob("*.yaml"))
DEFAULTS_YAML = CONFIGS / "common" / "true_on_policy.yaml"

# One valid non-default value per key, as a user types it on the command line.
OVERRIDES = {
    "deterministic": ("false", False),
    "platform": ("cuda", "cuda"),
    "kernels": ("project", "project"),
    "delta": ("0.01", 0.01),
    "negative_token_fraction": ("0.5", 0.5),
    "failure_reward_threshold": ("0.25", 0.25),
    "relax_invariants": ("[single_rollout,no_kl]", ["single_rollout", "no_kl"]),
    "allow_contract_mismatch": ("true", True),
    "accept_unverified": ("[attention,gemm]", ["attention", "gemm"]),
    "attention_backend": ("flash_attn", "flash_attn"),
    "row_parallel_reduction": ("all_reduce", "all_reduce"),
    "moe_dispatcher": ("alltoall", "alltoall"),
    "moe_combine": ("expert_major", "expert_major"),
    "moe_router_dtype": ("fp32", "fp32"),
    "cpu_tensor_parallel_size": ("2", 2),
    "cpu_expert_parallel_size": ("2", 2),
    "stack_versions": ("{torch:'2.13.0'}", {"torch": "2.13.0"}),
}


def test_the_shipped_configs_are_found():
    assert {"cpu_tiny", "cpu_tiny_async", "cpu_tiny_moe", "qwen3_30b_a3b_ascend", "qwen3_30b_a3b_cuda"} <= set(SHIPPED)


def test_the_defaults_yaml_is_the_dataclass():
    section = yaml.safe_load(DEFAULTS_YAML.read_text())["true_on_policy"]
    assert list(section) == list(settings.defaults())  # every key, in the dataclass's order
    assert Settings.from_mapping(section) == Settings()  # each at its default (stack_versions: null = {})
    assert {key: value for key, value in section.items() if key != "stack_versions"} == {
        key: value for key, value in settings.defaults().items() if key != "stack_versions"
    }


def test_every_key_has_an_override_value_here():
    assert set(OVERRIDES) == set(settings.defaults())


@pytest.mark.parametrize("config_name", SHIPPED)
def test_every_shipped_config_carries_every_key(config_name):
    section = OmegaConf.to_container(compose_config(str(CONFIGS), config_name).true_on_policy)
    assert set(section) == set(settings.defaults())
    Settings.from_mapping(section)  # and it validates


@pytest.mark.parametrize("config_name", ["cpu_tiny", "qwen3_30b_a3b_ascend"])
@pytest.mark.parametrize("key", sorted(OVERRIDES))
def test_every_key_is_overridable_without_plus(config_name, key):
    override = f"true_on_policy.{key}={OVERRIDES[key][0]}"
    expected = OVERRIDES[key][1]
    if key == "stack_versions" and config_name != "cpu_tiny":
        # Hydra merges a dict into a declared one: a declared package's version is overridable as is
        # (a package the config does not declare needs `+`, Hydra's rule for any new dict entry).
        override = "true_on_policy.stack_versions.cann=8.3.RC1"
        declared = OmegaConf.to_container(compose_config(str(CONFIGS), config_name).true_on_policy.stack_versions)
        assert declared["cann"] != "8.3.RC1"
        expected = {**declared, "cann": "8.3.RC1"}
    composed = compose_config(str(CONFIGS), config_name, [override])
    assert OmegaConf.to_container(composed.true_on_policy)[key] == expected


def test_an_unknown_key_still_needs_plus_and_is_then_named():
    with pytest.raises(Exception, match="deterministc"):
        compose_config(str(CONFIGS), "cpu_tiny", ["true_on_policy.deterministc=true"])
    with pytest.raises(ConfigError, match=r"unknown key\(s\).*'deterministc'"):
        Settings.from_mapping({"deterministc": True})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("deterministic", "maybe"),
        ("deterministic", 1),
        ("platform", "tpu"),
        ("delta", -1),
        ("delta", "abc"),
        ("delta", True),
        ("delta", math.nan),
        ("negative_token_fraction", 1.5),
        ("failure_reward_threshold", math.inf),
        ("relax_invariants", "single_rollout"),
        ("allow_contract_mismatch", "yes"),
        ("attention_backend", 3),
        ("cpu_tensor_parallel_size", 0),
        ("cpu_expert_parallel_size", 1.5),
        ("stack_versions", ["torch"]),
    ],
)
def test_a_bad_value_is_a_config_error_naming_key_and_value(key, value):
    with pytest.raises(ConfigError) as raised:
        Settings.from_mapping({key: value})
    assert f"true_on_policy.{key}" in str(raised.value) and repr(value) in str(raised.value)


def test_without_exported_settings_nothing_runs_on_defaults(monkeypatch):
    monkeypatch.delenv(settings.ENV_VAR, raising=False)
    assert settings.current() is None
    with pytest.raises(SettingsNotExported, match="launch hook"):
        settings.require("the test")
    monkeypatch.setenv(settings.ENV_VAR, Settings(platform="cpu", delta=0.5).to_json())
    assert settings.require("the test").delta == 0.5


# --------------------------------------------------------------- through the real launch (no Ray)


def test_an_internal_error_is_reported_as_one(monkeypatch, capsys):
    from true_on_policy.contract import determinism_plan
    from true_on_policy.verl_adapter import launch

    def broken_plan(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(determinism_plan, "plan", broken_plan)
    config = compose_config(str(CONFIGS), "cpu_tiny")
    with pytest.raises(KeyError, match="a bug"):
        launch.launch_hook(config)
    assert "INTERNAL ERROR" in capsys.readouterr().err


def test_a_config_error_in_the_hook_exits_2(capsys):
    from true_on_policy.verl_adapter import launch

    config = compose_config(str(CONFIGS), "cpu_tiny", ["true_on_policy.negative_token_fraction=7"])
    with pytest.raises(SystemExit) as exited:
        launch.launch_hook(config)
    assert exited.value.code == 2
    assert "true_on_policy.negative_token_fraction must be in [0, 1], got 7" in capsys.readouterr().err


def test_a_process_parses_the_exported_settings_once(monkeypatch):
    monkeypatch.setenv(settings.ENV_VAR, Settings(platform="cpu", delta=0.25).to_json())
    first = settings.current()
    assert settings.current() is first  # per step / per micro-batch: the cached object
    monkeypatch.setenv(settings.ENV_VAR, Settings(platform="cpu", delta=0.5).to_json())
    assert settings.current().delta == 0.5  # the twin: another export is parsed again


def test_exported_settings_carry_a_resolved_platform():
    assert Settings().platform == "auto"
    with pytest.raises(ValueError, match="resolved platform"):
        Settings().to_json()
    with pytest.raises(ValueError, match="resolved platform"):
        Settings.from_json('{"platform": "auto"}')
    assert Settings.from_json(Settings().on_platform("cuda").to_json()).platform == "cuda"
