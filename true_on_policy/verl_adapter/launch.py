"""The launch hook: what runs in verl's driver before Ray starts, and in each worker at import.

``python -m verl.trainer.main_ppo`` imports verl (which loads this plugin), then calls
``auto_set_device(config)`` first thing in ``main``, before ``ray.init``. ``main_ppo`` binds that
name when it is imported, after the plugin loaded, so wrapping it here reaches the real launch.
The wrapper does nothing unless the config has a ``true_on_policy:`` section; then, before any
Ray process exists, it

1. validates the section (:class:`true_on_policy.settings.Settings`),
2. enforces the FlashREINFORCE invariants (:mod:`true_on_policy.invariants`) and the settings
   the verl loss can honour,
3. refuses a launch whose training and rollout sides are not pinned identically
   (:mod:`true_on_policy.contract`), unless ``true_on_policy.allow_contract_mismatch=true``,
4. exports the settings and the platform's determinism environment into the driver's environment
   and into ``ray_kwargs.ray_init.runtime_env`` (which main_ppo merges into ``ray.init``), so every
   worker sees them before it builds a model.

In a worker, :func:`activate_from_environment` (called by the plugin at import) switches on what
the exported settings ask for: the CPU backend and the consistent kernels.
"""

from __future__ import annotations

import functools
import logging

from true_on_policy import settings as settings_module
from true_on_policy.settings import Settings

logger = logging.getLogger("true_on_policy")

# Environment exported to every Ray worker, beyond the settings themselves.
CPU_PLATFORM_ENV = {"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cpu"}


def recipe_section(config):
    """The ``true_on_policy`` section of a verl config, or None when the recipe is not in use."""
    try:
        return config.get("true_on_policy")
    except AttributeError:
        return None


def launch_environment(config) -> dict[str, str]:
    """Check a config that uses the recipe and return the environment its workers need.

    Raises ValueError naming every problem found. Pure with respect to the process: nothing is
    exported here (see :func:`prepare_launch`).
    """
    from omegaconf import OmegaConf

    from true_on_policy import contract, determinism_env, invariants
    from true_on_policy.verl_adapter import flashreinforce_registration

    section = recipe_section(config)
    resolved = OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else section
    recipe = Settings.from_mapping(resolved)
    invariants.enforce_invariants(config, relax=recipe.relax_invariants)
    flashreinforce_registration.require_supported_settings(recipe)
    mismatches = contract.compare(contract.build_contract(config))
    if mismatches and not recipe.allow_contract_mismatch:
        lines = "\n".join(f"  - {mismatch}" for mismatch in mismatches)
        raise ValueError(
            "training and rollout are not pinned identically, so log-probs cannot match bitwise:\n"
            f"{lines}\nFix the config, or launch anyway with true_on_policy.allow_contract_mismatch=true."
        )
    for mismatch in mismatches:
        logger.warning("true_on_policy: contract mismatch allowed by config: %s", mismatch)
    env = settings_module.export(recipe, {})
    env.update(determinism_env.worker_environment(recipe.deterministic, recipe.platform))
    if recipe.platform == "cpu":
        env.update(CPU_PLATFORM_ENV)
    return env


def prepare_launch(config) -> dict[str, str]:
    """Check the config and export its worker environment into this (driver) process."""
    import os

    env = launch_environment(config)
    os.environ.update(env)
    return env


def install_driver_hooks() -> None:
    """Wrap ``auto_set_device``, the first call ``main_ppo.main`` makes. Inert without the section."""
    import verl.utils.device as verl_device

    if getattr(verl_device.auto_set_device, "_true_on_policy", False):
        return
    original_auto_set_device = verl_device.auto_set_device

    @functools.wraps(original_auto_set_device)
    def auto_set_device(config):
        if recipe_section(config) is not None:
            env = prepare_launch(config)
            _add_to_ray_runtime_env(config, env)
            if env.get("VERL_PLATFORM") == "cpu":
                _select_cpu_platform()
        return original_auto_set_device(config)

    auto_set_device._true_on_policy = True
    verl_device.auto_set_device = auto_set_device


def _add_to_ray_runtime_env(config, env: dict[str, str]) -> None:
    """main_ppo merges ``ray_kwargs.ray_init.runtime_env`` over verl's defaults at ray.init."""
    from omegaconf import open_dict

    with open_dict(config):
        runtime_env = config.ray_kwargs.ray_init.setdefault("runtime_env", {})
        env_vars = runtime_env.setdefault("env_vars", {})
        for key, value in env.items():
            env_vars[key] = value


def _select_cpu_platform() -> None:
    """The driver may have resolved verl's platform before the hook ran (verl.trainer.constants_ppo
    probes the device at import, when VERL_PLATFORM was not set yet): select the CPU platform."""
    from verl.plugin.platform import get_platform, set_platform

    from true_on_policy.verl_adapter.cpu_platform import PlatformCPU

    if get_platform().device_name != "cpu":
        set_platform(PlatformCPU())


def activate_from_environment() -> Settings | None:
    """In any process: switch on what the exported settings ask for. Returns them (or None)."""
    recipe = settings_module.current()
    if recipe is None:
        return None
    from true_on_policy.verl_adapter import behaviour_log_probs

    behaviour_log_probs.install()
    if recipe.platform == "cpu":
        from true_on_policy.verl_adapter import cpu_platform

        cpu_platform.activate()
    if recipe.deterministic:
        from true_on_policy.verl_adapter import consistent_training

        consistent_training.activate()
    return recipe
