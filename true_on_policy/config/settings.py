"""The ``true_on_policy:`` config section: its schema, validation and transport to Ray workers.

verl's own config dataclasses (``AlgoConfig``, ``PolicyLossConfig``) reject unknown keys, so the
recipe's knobs live in one top-level section of the Hydra config. The launch hook validates it in
the driver before Ray starts and exports it as one JSON environment variable through Ray's
``runtime_env``; every worker process reads it back with :func:`current`. No verl import here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

ENV_VAR = "TRUE_ON_POLICY_SETTINGS"

PLATFORMS = ("cpu", "ascend", "cuda")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every key of the ``true_on_policy:`` section, with its default."""

    # One switch for the consistent (batch-invariant, order-fixed) kernels on both engines.
    deterministic: bool = True
    # Where the job runs; selects the determinism environment and, for "cpu", the CPU backend.
    platform: str = "cpu"
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
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"true_on_policy.deterministic must be a bool, got {self.deterministic!r}")
        if self.platform not in PLATFORMS:
            raise ValueError(f"true_on_policy.platform must be one of {PLATFORMS}, got {self.platform!r}")
        if not isinstance(self.delta, (int, float)) or math.isnan(self.delta) or self.delta < 0:
            raise ValueError(f"true_on_policy.delta must be a number >= 0 (inf disables the gate), got {self.delta!r}")
        q = self.negative_token_fraction
        if not isinstance(q, (int, float)) or not 0.0 <= q <= 1.0:
            raise ValueError(f"true_on_policy.negative_token_fraction must be in [0, 1], got {q!r}")
        if not isinstance(self.failure_reward_threshold, (int, float)) or not math.isfinite(
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

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any] | None) -> Settings:
        """Build from the config section; an unknown key is an error that names it."""
        section = dict(section or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"unknown key(s) in true_on_policy section: {unknown}; known keys: {sorted(known)}")
        for key in ("relax_invariants", "accept_unverified"):
            if key in section:
                names = section[key]
                if isinstance(names, str) or not all(isinstance(name, str) for name in (names or ())):
                    raise ValueError(f"true_on_policy.{key} must be a list of names, got {names!r}")
                section[key] = tuple(names or ())
        if section.get("stack_versions") is not None:
            section["stack_versions"] = {str(k): str(v) for k, v in dict(section["stack_versions"]).items()}
        return cls(**section)

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        fields["stack_versions"] = dict(self.stack_versions)
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Settings:
        return cls.from_mapping(json.loads(text))


def current() -> Settings | None:
    """The settings exported to this process, or None when no launch configured the recipe."""
    text = os.environ.get(ENV_VAR)
    return Settings.from_json(text) if text else None


def export(settings: Settings, env: dict[str, str] | None = None) -> dict[str, str]:
    """Write the settings into ``env`` (default: this process's environment) and return it."""
    env = os.environ if env is None else env
    env[ENV_VAR] = settings.to_json()
    return env
