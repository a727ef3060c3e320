"""The launch hook: what runs in verl's driver before Ray starts, and in each process at import.

``python -m verl.trainer.main_ppo`` imports verl (which loads this plugin), then calls
``auto_set_device(config)`` first thing in ``main``, before ``ray.init``. ``main_ppo`` binds that
name when it is imported, after the plugin loaded, so wrapping it here reaches the real launch.
The wrapper does nothing unless the config has a ``true_on_policy:`` section; then, before any
Ray process exists, :func:`prepare_launch`

1. validates the section (:class:`true_on_policy.config.settings.Settings`),
2. enforces the FlashREINFORCE invariants (:mod:`true_on_policy.config.invariants`),
3. pins the platform's determinism plan into the config (:mod:`true_on_policy.contract.determinism_plan`),
4. refuses a launch whose training and rollout sides are not pinned identically
   (:mod:`true_on_policy.contract.consistency`), unless ``true_on_policy.allow_contract_mismatch=true``,
5. exports the settings and the plan's worker environment into the driver's environment and into
   ``ray_kwargs.ray_init.runtime_env.env_vars`` (which main_ppo merges into ``ray.init``), so
   every Ray worker sees them before it builds a model.

In every process, :func:`activate_from_environment` (called by the plugin at import) switches on
what the exported settings ask for: the plan's in-process calls, the trainer hooks, and on the
CPU platform the CPU backend and the project's kernels.
"""

from __future__ import annotations

import functools
import json
import logging
import os

from true_on_policy.config import settings as settings_module
from true_on_policy.config.settings import Settings

logger = logging.getLogger("true_on_policy")

# Environment exported to every Ray worker, beyond the settings and the determinism plan.
CPU_PLATFORM_ENV = {"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cpu"}
# The plan's in-process calls (e.g. torch.use_deterministic_algorithms on torch_npu), as JSON.
IN_PROCESS_ENV = "TRUE_ON_POLICY_IN_PROCESS"


def recipe_section(config):
    """The ``true_on_policy`` section of a verl config, or None when the recipe is not in use."""
    try:
        return config.get("true_on_policy")
    except AttributeError:
        return None


def prepare_launch(config) -> dict[str, str]:
    """Check a config that uses the recipe, pin its determinism plan, export its environment.

    Raises ValueError naming every problem found. On success ``config`` carries the plan's values
    (worker environment, rollout and training engine settings) and the returned environment is in
    this process's ``os.environ`` too.
    """
    from omegaconf import OmegaConf, open_dict

    from true_on_policy.contract import consistency as contract

    from true_on_policy.contract import determinism_plan as determinism_env

    from true_on_policy.config import invariants

    section = recipe_section(config)
    resolved = OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else section
    recipe = Settings.from_mapping(resolved)
    invariants.enforce_invariants(config, relax=recipe.relax_invariants)
    if recipe.platform == "cpu" and (recipe.cpu_tensor_parallel_size > 1 or recipe.cpu_expert_parallel_size > 1):
        raise ValueError(
            "true_on_policy.cpu_tensor_parallel_size / cpu_expert_parallel_size > 1: CPU TP/EP is implemented "
            "at library level (true_on_policy.kernels.tensor_parallel) and proven bitwise there, but neither verl's FSDP "
            "engine nor the Ray-served CPU rollout shards the model; run CPU jobs with both set to 1"
        )

    plan = determinism_env.plan_for_config(config)
    env = settings_module.export(recipe, {})
    env.update(plan.worker_env)
    if plan.deterministic and plan.in_process:
        env[IN_PROCESS_ENV] = json.dumps([[name, kwargs] for name, kwargs in plan.in_process])
    if recipe.platform == "cpu":
        env.update(CPU_PLATFORM_ENV)
        if config.actor_rollout_ref.rollout.name == "vllm":
            env.update(_vllm_cpu_env(config))
    updates = determinism_env.config_updates(plan)
    updates.update({f"{determinism_env.ENV_PATH}.{key}": value for key, value in env.items()})
    with open_dict(config):
        for path, value in updates.items():
            OmegaConf.update(config, path, value, force_add=True)

    mismatches = contract.compare(contract.build_contract(config, plan=plan))
    if mismatches and not recipe.allow_contract_mismatch:
        lines = "\n".join(f"  - {mismatch}" for mismatch in mismatches)
        raise ValueError(
            "training and rollout are not pinned identically, so log-probs cannot match bitwise:\n"
            f"{lines}\nFix the config, or launch anyway with true_on_policy.allow_contract_mismatch=true."
        )
    for mismatch in mismatches:
        logger.warning("true_on_policy: contract mismatch allowed by config: %s", mismatch)
    os.environ.update(env)
    return env


def _vllm_cpu_env(config) -> dict[str, str]:
    """rollout.name=vllm on CPU: the training side masks the logits verl's vLLM rollout masks."""
    from transformers import AutoTokenizer

    from true_on_policy.verl_adapter.consistent_training import ROLLOUT_VOCAB_ENV

    model = config.actor_rollout_ref.model
    tokenizer = AutoTokenizer.from_pretrained(model.get("tokenizer_path") or model.path)
    # VLLM_TARGET_DEVICE: vLLM's platform detection, explicit rather than read from a version string.
    return {ROLLOUT_VOCAB_ENV: str(len(tokenizer)), "VLLM_TARGET_DEVICE": "cpu"}


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
            if env.get("VERL_PLATFORM") == "cpu":
                _select_cpu_platform()
        return original_auto_set_device(config)

    auto_set_device._true_on_policy = True
    verl_device.auto_set_device = auto_set_device


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
    from true_on_policy.contract import determinism_plan as determinism_env
    from true_on_policy.verl_adapter import trainer_hooks

    if os.environ.get(IN_PROCESS_ENV):
        determinism_env.run_in_process_calls(recipe.platform, json.loads(os.environ[IN_PROCESS_ENV]))
    trainer_hooks.install()
    if recipe.platform == "cpu":
        # The project's kernels are the CPU reference path; on Ascend and CUDA the determinism
        # plan's vendor settings (exported above) pin the engines' own kernels instead.
        from true_on_policy.verl_adapter import consistent_training, cpu_platform

        cpu_platform.activate()
        consistent_training.activate(recipe.deterministic)
    return recipe
