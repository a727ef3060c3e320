"""The ``true_on_policy:`` config section: its schema, validation and transport to Ray workers.

verl's own config dataclasses (``AlgoConfig``, ``PolicyLossConfig``) reject unknown keys, so the
recipe's knobs live in one top-level section of the Hydra config. The launch hook validates it in
the driver before Ray starts and exports it as one JSON environment variable through Ray's
``runtime_env``; every worker process reads it back with :func:`require` (the registered loss and
advantage refuse to run without it: no silent defaults). No verl import here.

The dataclass is the one schema of the section: ``configs/common/true_on_policy.yaml`` lists every
key with the default below (tests/unit/test_settings.py holds them equal), so each key is overridable
on the command line without ``+``. A bad value raises :class:`ConfigError` naming key and value;
the launch turns it into exit status 2 before Ray starts.

Parsed once per process: the driver's verdict (:func:`true_on_policy.contract.verdict.decide`) builds
the one :class:`Settings` and hands it on (plan, contract, export); a worker's :func:`current` parses
the exported JSON the first time it is asked and returns that same object afterwards.

``platform: auto`` (the default) is resolved from the machine by the verdict
(:mod:`true_on_policy.config.platform`), never silently assumed; the exported settings always carry
the resolved platform.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from true_on_policy.config.platforms import PLATFORMS, Platform, resolved

ENV_VAR = "TRUE_ON_POLICY_SETTINGS"

# "auto": detected from the machine (true_on_policy.config.platform) and logged with the reason.
AUTO_PLATFORM = "auto"
PLATFORM_CHOICES = (AUTO_PLATFORM, *PLATFORMS)
KERNELS = (None, "engine", "project")


_NO_VALUE = object()


class ConfigError(ValueError):
    """A bad value in the user's config, not a bug of ours: ``ConfigError(key, value, expected)`` names
    the key and the value; ``ConfigError(message)`` where the message names them itself."""

    def __init__(self, key: str, value: Any = _NO_VALUE, expected: str = ""):
        if value is _NO_VALUE:
            self.key, self.value, self.expected = None, None, ""
            super().__init__(key)
        else:
            self.key, self.value, self.expected = key, value, expected
            super().__init__(f"{key}={value!r}: {expected}")


class SettingsNotExported(RuntimeError):
    """This process has no settings validated and exported by the launch hook."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every key of the ``true_on_policy:`` section, with its default."""

    # The one flag: the consistent kernels (order-fixed, rule by rule) on both engines.
    deterministic: bool = True
    # Where the job runs (resolved to its true_on_policy.config.platforms object); selects the
    # determinism environment and, for "cpu", the CPU backend.
    # "auto": detected from the machine (torch_npu -> ascend, CUDA -> cuda, else cpu), logged with the reason.
    platform: str = AUTO_PLATFORM
    # Which kernel family the flag switches on, on both sides: "project" (true_on_policy.kernels in the
    # HF training model and, through true_on_policy.vllm_adapter, in vLLM) or "engine" (each engine's
    # own deterministic kernels, pinned by the determinism plan). null = the platform's family:
    # project on cpu, engine on ascend / cuda.
    kernels: str | None = None
    # Sequence Trust Region: a trajectory is admitted iff its mean Bernoulli KL is <= delta.
    delta: float = 3e-3
    # Entropy filter on failed trajectories: keep this fraction of their policy tokens (1.0 = off).
    negative_token_fraction: float = 1.0
    # A trajectory counts as failed for the entropy filter iff its sequence reward is <= this.
    failure_reward_threshold: float = 0.0
    # FlashREINFORCE invariants (true_on_policy.config.invariants) relaxed on purpose, by name.
    relax_invariants: tuple[str, ...] = ()
    # Launch even when the training and rollout sides are not pinned identically (contract check).
    allow_contract_mismatch: bool = False
    # Contract rows (field names) accepted as unverified: without them the launch refuses such rows.
    accept_unverified: tuple[str, ...] = ()
    # Pins for what verl's config has no key for; both sides must resolve to them (true_on_policy.contract.consistency).
    attention_backend: str | None = None  # attention family both sides run, e.g. "flash_attn"
    row_parallel_reduction: str | None = None  # "none" | "all_reduce" | "reduce_scatter+all_gather"
    moe_dispatcher: str | None = None  # "local" | "alltoall" | "allgather"
    moe_combine: str | None = None  # MoE combine order, e.g. "expert_major"
    moe_router_dtype: str | None = None  # e.g. "fp32"
    # CPU backend sharding (true_on_policy.kernels.tensor_parallel); the contract compares them with the
    # rollout's TP/EP. Library-level only: a verl launch with either > 1 is refused.
    cpu_tensor_parallel_size: int = 1
    cpu_expert_parallel_size: int = 1
    # The stack the config is written for (package -> version); an installed package's version wins.
    stack_versions: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.platform, Platform):  # a name -> its platform object
            object.__setattr__(self, "platform", resolved(self.platform))
        try:
            self._validate()
        except ValueError as error:
            raise ConfigError(str(error)) from None

    def _validate(self) -> None:
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"true_on_policy.deterministic must be a bool, got {self.deterministic!r}")
        if self.platform not in PLATFORM_CHOICES:
            raise ValueError(f"true_on_policy.platform must be one of {PLATFORM_CHOICES}, got {self.platform!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"true_on_policy.kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.kernels == "engine" and isinstance(self.platform, Platform) and not self.platform.has_engine_kernels:
            raise ValueError(
                "true_on_policy.kernels='engine' on platform cpu: the CPU platform has no engine deterministic "
                "kernels, only the project's; use 'project' or null"
            )
        if not _is_number(self.delta) or math.isnan(self.delta) or self.delta < 0:
            raise ValueError(f"true_on_policy.delta must be a number >= 0 (inf disables the gate), got {self.delta!r}")
        q = self.negative_token_fraction
        if not _is_number(q) or not 0.0 <= q <= 1.0:
            raise ValueError(f"true_on_policy.negative_token_fraction must be in [0, 1], got {q!r}")
        if not _is_number(self.failure_reward_threshold) or not math.isfinite(
            self.failure_reward_threshold
        ):
            raise ValueError(
                f"true_on_policy.failure_reward_threshold must be a finite number, got {self.failure_reward_threshold!r}"
            )
        for name in ("attention_backend", "row_parallel_reduction", "moe_dispatcher", "moe_combine", "moe_router_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"true_on_policy.{name} must be a string or null, got {value!r}")
        for name in ("cpu_tensor_parallel_size", "cpu_expert_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"true_on_policy.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.stack_versions, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.stack_versions.items()
        ):
            raise ValueError(f"true_on_policy.stack_versions must map package names to version strings, got {self.stack_versions!r}")
        if not isinstance(self.allow_contract_mismatch, bool):
            raise ValueError(
                f"true_on_policy.allow_contract_mismatch must be a bool, got {self.allow_contract_mismatch!r}"
            )

    # resolved_kernels / consistent_kernels: computed once per object (the frozen dataclass keeps the
    # value in its __dict__, outside the fields that asdict and to_json write)
    @functools.cached_property
    def resolved_kernels(self) -> str:
        """The kernel family the flag switches on: "project" (the project's kernels on both engines) or
        "engine" (each engine's own deterministic kernels, pinned by the plan). Needs a resolved platform."""
        if self.platform not in PLATFORMS:
            raise ValueError(f"true_on_policy.platform={self.platform!r} is not resolved to one of {PLATFORMS}")
        return self.kernels or self.platform.default_kernels

    @functools.cached_property
    def consistent_kernels(self) -> bool:
        """The one switch of both engines' kernels: the project's consistent kernels run in this process."""
        return self.deterministic and self.resolved_kernels == "project"

    def on_platform(self, platform: str) -> Settings:
        """These settings with ``platform`` resolved (validated again: e.g. kernels=engine on cpu)."""
        return dataclasses.replace(self, platform=platform)

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any] | None) -> Settings:
        """Build from the config section; an unknown key is an error that names it."""
        section = dict(section or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(f"unknown key(s) in true_on_policy section: {unknown}; known keys: {sorted(known)}")
        for key in ("relax_invariants", "accept_unverified"):
            if key in section:
                names = section[key]
                if isinstance(names, str) or not all(isinstance(name, str) for name in (names or ())):
                    raise ConfigError(f"true_on_policy.{key} must be a list of names, got {names!r}")
                section[key] = tuple(names or ())
        if "stack_versions" in section and section["stack_versions"] is None:
            section["stack_versions"] = {}  # null in YAML: nothing declared
        if section.get("stack_versions") is not None:
            versions = section["stack_versions"]
            if not isinstance(versions, Mapping):
                raise ConfigError(f"true_on_policy.stack_versions must map package names to versions, got {versions!r}")
            section["stack_versions"] = {str(k): str(v) for k, v in dict(versions).items()}
        return cls(**section)

    @classmethod
    def from_config(cls, config: Any) -> Settings | None:
        """The ``true_on_policy:`` section of a composed config, resolved and parsed; None without one."""
        try:
            section = config.get("true_on_policy")
        except AttributeError:
            return None
        if section is None:
            return None
        if hasattr(section, "_get_node"):  # an OmegaConf node: resolve its interpolations first
            from omegaconf import OmegaConf
            from omegaconf.errors import OmegaConfBaseException

            try:
                section = OmegaConf.to_container(section, resolve=True)
            except OmegaConfBaseException as error:
                raise ConfigError(f"true_on_policy: the section cannot be resolved: {error}") from error
        if not isinstance(section, Mapping):
            raise ConfigError(f"true_on_policy must be a mapping of settings, got {section!r}")
        return cls.from_mapping(section)

    def to_json(self) -> str:
        """The exported form; the platform must be resolved (workers never see ``auto``)."""
        _require_resolved(self.platform)
        fields = dataclasses.asdict(self)
        fields["stack_versions"] = dict(self.stack_versions)
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Settings:
        settings = cls.from_mapping(json.loads(text))
        _require_resolved(settings.platform)
        return settings


def resolve_platform(settings: Settings, machine: Any, launching: bool, refusals: list[str], notes: list[str]) -> Settings | None:
    """``settings`` with the platform resolved on ``machine`` (a :class:`~true_on_policy.config.platform.Machine`);
    None when that itself is a bad value. ``auto`` is the machine's platform (noted with the reason); an
    explicit one that is not this machine's is refused when ``launching``, noted otherwise (``check``
    evaluates it as declared)."""
    declared = settings.platform
    if declared == AUTO_PLATFORM:
        notes.append(f"platform: true_on_policy.platform=auto detected {machine.platform} ({machine.reason})")
        platform = machine.platform
    else:
        platform = declared
        if declared != machine.platform:
            if launching:
                refusals.append(
                    f"bad config value: true_on_policy.platform={declared!r} but this machine is {machine.platform} "
                    f"({machine.reason}); set true_on_policy.platform={machine.platform} (or auto), or launch on a "
                    f"{declared} machine"
                )
            else:
                notes.append(
                    f"platform: evaluated as declared, true_on_policy.platform={declared!r}; this machine is "
                    f"{machine.platform} ({machine.reason}), so a launch here is refused"
                )
        else:
            notes.append(f"platform: true_on_policy.platform={declared!r} is this machine ({machine.reason})")
    try:
        return settings.on_platform(platform)
    except ConfigError as error:
        refusals.append(f"bad config value: {error}")
        return None


def platform_limits(settings: Settings) -> list[str]:
    """What the resolved platform cannot run of ``settings`` (CPU TP/EP is library level only)."""
    if settings.platform.cpu_backend and (settings.cpu_tensor_parallel_size > 1 or settings.cpu_expert_parallel_size > 1):
        return [
            "bad config value: true_on_policy.cpu_tensor_parallel_size / cpu_expert_parallel_size > 1 "
            f"(got {settings.cpu_tensor_parallel_size} / {settings.cpu_expert_parallel_size}): CPU TP/EP is implemented "
            "at library level (true_on_policy.kernels.tensor_parallel) and proven bitwise there, but neither verl's FSDP "
            "engine nor the Ray-served CPU rollout shards the model; run CPU jobs with both set to 1"
        ]
    return []


def _require_resolved(platform: str) -> None:
    if platform not in PLATFORMS:
        raise ValueError(
            f"true_on_policy: exported settings carry a resolved platform (one of {PLATFORMS}), got {platform!r}"
        )


def defaults() -> dict[str, Any]:
    """Every key of the section with its default, as plain YAML-able values."""
    fields = dataclasses.asdict(Settings())
    fields["relax_invariants"] = list(fields["relax_invariants"])
    fields["accept_unverified"] = list(fields["accept_unverified"])
    fields["stack_versions"] = dict(fields["stack_versions"])
    return fields


def current() -> Settings | None:
    """The settings exported to this process, or None when no launch configured the recipe.

    Parsed once: the same exported text gives the same cached object (per step and per micro-batch
    callers pay a dictionary lookup, not a parse)."""
    text = os.environ.get(ENV_VAR)
    return _parsed(text) if text else None


@functools.lru_cache(maxsize=4)
def _parsed(text: str) -> Settings:
    return Settings.from_json(text)


def require(what: str) -> Settings:
    """The exported settings; :class:`SettingsNotExported` (naming ``what`` needs them) when absent."""
    recipe = current()
    if recipe is None:
        raise SettingsNotExported(
            f"true_on_policy: {what} needs the true_on_policy settings validated and exported by the launch "
            f"hook, and this process has none ({ENV_VAR} is unset). Launch with `python -m "
            "verl.trainer.main_ppo` and a config that has a true_on_policy: section (e.g. compose "
            "configs/common/true_on_policy.yaml); refusing to run on default settings."
        )
    return recipe


def export(settings: Settings, env: dict[str, str] | None = None) -> dict[str, str]:
    """Write the settings into ``env`` (default: this process's environment) and return it."""
    env = os.environ if env is None else env
    env[ENV_VAR] = settings.to_json()
    return env
