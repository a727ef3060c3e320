"""The launch hook: what runs in verl's driver before Ray starts, and in each process at import.

``python -m verl.trainer.main_ppo`` imports verl (which loads this plugin), then calls
``auto_set_device(config)`` first thing in ``main``, before ``ray.init``; the plugin wraps it
(:func:`true_on_policy.verl_adapter.patches.install_launch_hook`) to run :func:`launch_hook`.
That does nothing unless the config has a ``true_on_policy:`` section (or trains with
FlashREINFORCE); then, before any Ray process exists, it

1. asks for the verdict, :func:`true_on_policy.contract.verdict.decide` -- the same function
   ``python -m true_on_policy check`` and the dry runs call -- prints its text on stderr and exits
   with its code unless it is 0 (nothing was started);
2. applies it (:func:`apply_verdict`): writes the platform's determinism plan into the config and
   exports the settings and the plan's worker environment into the driver's environment and into
   ``ray_kwargs.ray_init.runtime_env.env_vars`` (which main_ppo merges into ``ray.init``), so every
   Ray worker sees them before it builds a model.

Any exception other than the verdict's is reported as an internal error. Should the hook not run
(verl renamed its target, another entry point), verl's trainer refuses to start
(:func:`trainer_start_check`), and the registered loss and advantage refuse to run without exported
settings.

In every process, :func:`activate_from_environment` (called by the plugin at import) switches on
what the exported settings ask for: the plan's in-process calls, the trainer hooks, and, from
``Settings.consistent_kernels`` (the one switch), the project's kernels (with the CPU backend on cpu).
"""

from __future__ import annotations

import json
import logging
import os
import sys

from true_on_policy.config.platforms import is_cpu_device, is_vllm
from true_on_policy.config.settings import Settings, SettingsNotExported, current, export

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


def launch_verdict(config):
    """The verdict of :mod:`true_on_policy.contract.verdict` for launching ``config`` on this machine."""
    from true_on_policy.config.platform import detect_machine
    from true_on_policy.contract import verdict

    return verdict.decide(config, machine=detect_machine(), launching=True)


def apply_verdict(config, verdict) -> dict[str, str]:
    """Write an accepted verdict's plan into ``config`` and export its environment (returned, and in
    this process's ``os.environ``)."""
    from omegaconf import OmegaConf, open_dict

    from true_on_policy.contract import determinism_plan
    from true_on_policy.verl_adapter import patches

    recipe, plan = verdict.settings, verdict.plan
    # The plan's provenance (versions detected or declared, what was not emitted and why) goes to the log.
    logger.info("true_on_policy: %s", determinism_plan.describe(plan))
    for note in plan.notes:
        logger.warning("true_on_policy: determinism plan note: %s", note)
    env = export(recipe, {})
    env.update(plan.worker_env)
    if plan.deterministic and plan.in_process:
        env[IN_PROCESS_ENV] = json.dumps([[name, kwargs] for name, kwargs in plan.in_process])
    rollout_name = verdict.contract.rollout_engine
    if is_vllm(rollout_name):
        env.update(patches.weight_sync_run_env())  # the launch's own weight-sync socket paths
    if recipe.platform.cpu_backend:
        env.update(CPU_PLATFORM_ENV)
        if is_vllm(rollout_name):
            env.update(_vllm_cpu_env(config))
    elif recipe.consistent_kernels and is_vllm(rollout_name):
        env.update(_rollout_vocab_env(config))  # kernels=project on a device: written, not run on a device
    updates = plan.config_updates
    updates.update({f"{determinism_plan.ENV_PATH}.{key}": value for key, value in env.items()})
    with open_dict(config):
        for path, value in updates.items():
            OmegaConf.update(config, path, value, force_add=True)
    os.environ.update(env)
    return env


def _rollout_vocab_env(config) -> dict[str, str]:
    """rollout.name=vllm on the project's kernels: the training side masks the logits verl's vLLM rollout masks."""
    from transformers import AutoTokenizer

    from true_on_policy.verl_adapter.consistent_training import ROLLOUT_VOCAB_ENV

    model = config.actor_rollout_ref.model
    tokenizer = AutoTokenizer.from_pretrained(model.get("tokenizer_path") or model.path)
    return {ROLLOUT_VOCAB_ENV: str(len(tokenizer))}


def _vllm_cpu_env(config) -> dict[str, str]:
    # VLLM_TARGET_DEVICE: vLLM's platform detection, explicit rather than read from a version string.
    return {**_rollout_vocab_env(config), "VLLM_TARGET_DEVICE": "cpu"}


def launch_hook(config) -> None:
    """What the wrapped ``auto_set_device`` runs first: inert without the section.

    Prints the verdict's text on stderr; a verdict other than 0 exits with its code before Ray
    starts. Any other exception is reported as an internal error of true_on_policy and re-raised.
    """
    from true_on_policy.config.launch import read_algorithm

    if recipe_section(config) is None and not read_algorithm(config).flashreinforce:
        return
    try:
        verdict = launch_verdict(config)
    except Exception:
        _internal_error()
        raise
    sys.stderr.write(verdict.text + "\n")
    sys.stderr.flush()
    if verdict.code != 0:
        raise SystemExit(verdict.code)
    try:
        env = apply_verdict(config, verdict)
    except Exception:
        _internal_error()
        raise
    if is_cpu_device(env.get("VERL_PLATFORM")):
        _select_cpu_platform()


def _internal_error() -> None:
    sys.stderr.write(
        "true_on_policy: INTERNAL ERROR while preparing the launch (a bug in true_on_policy, not in your "
        "config); please report it with the traceback below.\n"
    )


# Why the launch hook could not be installed in this process (verl renamed its target), if so.
launch_hook_error: str | None = None


def install_driver_hooks() -> None:
    """Wrap ``auto_set_device``, the first call ``main_ppo.main`` makes, and arm the trainer-start check.

    A launch hook that cannot be installed (verl renamed or changed ``auto_set_device``) does not
    stop the plugin from loading: the trainer-start check then fails the run, naming the reason.
    """
    global launch_hook_error
    from true_on_policy.verl_adapter import patches

    try:
        patches.install_launch_hook(launch_hook)
    except patches.PatchTargetChanged as error:
        launch_hook_error = str(error)
        sys.stderr.write(f"true_on_policy: the launch hook is NOT installed: {error}\n")
    patches.install_trainer_start_check(trainer_start_check)


def uses_recipe(config) -> bool:
    """The config has a ``true_on_policy:`` section or names the FlashREINFORCE loss or estimator."""
    from true_on_policy.config.launch import read_algorithm

    return recipe_section(config) is not None or read_algorithm(config).flashreinforce


def trainer_start_check(config) -> None:
    """At verl's trainer start: a config that uses the recipe needs the settings the launch exported."""
    if current() is not None or not uses_recipe(config):
        return
    reason = (
        f"The hook could not be installed: {launch_hook_error}"
        if launch_hook_error
        else "Was the run started by an entry point that does not call verl.utils.device.auto_set_device(config) "
        "before ray.init (as python -m verl.trainer.main_ppo does), or did verl stop calling it?"
    )
    raise SettingsNotExported(
        "true_on_policy: the true_on_policy launch hook did not run, so the true_on_policy: section was never "
        "validated and no invariants, determinism plan or consistency contract were applied; refusing to start "
        f"the trainer. {reason}"
    )


def _select_cpu_platform() -> None:
    """The driver may have resolved verl's platform before the hook ran (verl.trainer.constants_ppo
    probes the device at import, when VERL_PLATFORM was not set yet): select the CPU platform."""
    from verl.plugin.platform import get_platform, set_platform

    from true_on_policy.verl_adapter.cpu_platform import PlatformCPU

    if not is_cpu_device(get_platform().device_name):
        set_platform(PlatformCPU())


def activate_from_environment() -> Settings | None:
    """In any process: switch on what the exported settings ask for. Returns them (or None)."""
    recipe = current()
    if recipe is None:
        return None
    from true_on_policy.contract import determinism_plan
    from true_on_policy.verl_adapter import patches, resume, trainer_hooks

    if os.environ.get(IN_PROCESS_ENV):
        determinism_plan.run_in_process_calls(recipe.platform, json.loads(os.environ[IN_PROCESS_ENV]))
    trainer_hooks.install()
    resume.install()
    patches.install_launch_weight_sync_socket()
    if recipe.platform.cpu_backend:
        from true_on_policy.verl_adapter import cpu_platform

        cpu_platform.activate()
    # The project's kernels are the CPU reference path (and, with kernels: project, the CUDA one:
    # written, not run on a device); with kernels: engine the plan's vendor settings (exported above)
    # pin the engines' own kernels instead. The vLLM plugin switches on the same property.
    from true_on_policy.verl_adapter import consistent_training

    consistent_training.activate(recipe)
    return recipe
