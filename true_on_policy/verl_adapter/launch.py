"""The launch hook: what runs in verl's driver before Ray starts, and in each process at import.

``python -m verl.trainer.main_ppo`` imports verl (which loads this plugin), then calls
``auto_set_device(config)`` first thing in ``main``, before ``ray.init``; the plugin wraps it
(:func:`true_on_policy.verl_adapter.patches.install_launch_hook`) to run :func:`launch_hook`.
That does nothing unless the config has a ``true_on_policy:`` section; then, before any Ray
process exists, :func:`prepare_launch`

1. validates the section (:class:`true_on_policy.config.settings.Settings`),
2. enforces the FlashREINFORCE invariants (:mod:`true_on_policy.config.invariants`),
3. pins the platform's determinism plan into the config (:mod:`true_on_policy.contract.determinism_plan`),
4. refuses a launch whose training and rollout sides are not pinned identically
   (:mod:`true_on_policy.contract.consistency`), unless ``true_on_policy.allow_contract_mismatch=true``,
   and one with contract rows that cannot be verified, unless each is named in
   ``true_on_policy.accept_unverified`` (the same verdict as ``python -m true_on_policy check``),
5. exports the settings and the plan's worker environment into the driver's environment and into
   ``ray_kwargs.ray_init.runtime_env.env_vars`` (which main_ppo merges into ``ray.init``), so
   every Ray worker sees them before it builds a model.

A bad value exits with status 2 naming key and value; any other failure is reported as an
internal error. Should the hook not run (verl renamed its target, another entry point), verl's
trainer refuses to start (:func:`trainer_start_check`), and the registered loss and advantage
refuse to run without exported settings.

In every process, :func:`activate_from_environment` (called by the plugin at import) switches on
what the exported settings ask for: the plan's in-process calls, the trainer hooks, and on the
CPU platform the CPU backend and the project's kernels.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from true_on_policy.config import settings as settings_module
from true_on_policy.config.settings import ConfigError, Settings

logger = logging.getLogger("true_on_policy")

# Environment exported to every Ray worker, beyond the settings and the determinism plan.
CPU_PLATFORM_ENV = {"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cpu"}
# The plan's in-process calls (e.g. torch.use_deterministic_algorithms on torch_npu), as JSON.
IN_PROCESS_ENV = "TRUE_ON_POLICY_IN_PROCESS"
# Exit status of a launch refused for a bad config (as `python -m true_on_policy check` uses for a mismatch).
EXIT_CONFIG_ERROR = 2


def recipe_section(config):
    """The ``true_on_policy`` section of a verl config, or None when the recipe is not in use."""
    try:
        return config.get("true_on_policy")
    except AttributeError:
        return None


def prepare_launch(config) -> dict[str, str]:
    """Check a config that uses the recipe, pin its determinism plan, export its environment.

    Raises :class:`ConfigError` (a ValueError) naming the key and value of every problem found; any
    other exception is a bug of ours. On success ``config`` carries the plan's values (worker
    environment, rollout and training engine settings) and the returned environment is in this
    process's ``os.environ`` too.
    """
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    from true_on_policy.config import invariants
    from true_on_policy.contract import consistency as contract
    from true_on_policy.contract import determinism_plan as determinism_env
    from true_on_policy.kernels import architectures

    section = recipe_section(config)
    try:
        resolved = OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else section
    except OmegaConfBaseException as error:
        raise ConfigError(f"true_on_policy: the section cannot be resolved: {error}") from error
    recipe = Settings.from_mapping(resolved)
    invariants.enforce_invariants(config, relax=recipe.relax_invariants)
    if recipe.platform == "cpu" and (recipe.cpu_tensor_parallel_size > 1 or recipe.cpu_expert_parallel_size > 1):
        raise ConfigError(
            "true_on_policy.cpu_tensor_parallel_size / cpu_expert_parallel_size > 1 "
            f"(got {recipe.cpu_tensor_parallel_size} / {recipe.cpu_expert_parallel_size}): CPU TP/EP is implemented "
            "at library level (true_on_policy.kernels.tensor_parallel) and proven bitwise there, but neither verl's FSDP "
            "engine nor the Ray-served CPU rollout shards the model; run CPU jobs with both set to 1"
        )

    if recipe.deterministic and (recipe.platform == "cpu" or recipe.kernels == "project"):
        # the project's kernels on both sides: an uncovered architecture or feature is refused by name here
        architectures.check_checkpoint(config.actor_rollout_ref.model.path)

    plan = determinism_env.plan_for_config(config)
    # The plan's provenance (versions detected or declared, what was not emitted and why) goes to the log.
    logger.info("true_on_policy: %s", determinism_env.describe(plan))
    for note in plan.notes:
        logger.warning("true_on_policy: determinism plan note: %s", note)
    env = settings_module.export(recipe, {})
    env.update(plan.worker_env)
    if plan.deterministic and plan.in_process:
        env[IN_PROCESS_ENV] = json.dumps([[name, kwargs] for name, kwargs in plan.in_process])
    if recipe.platform == "cpu":
        env.update(CPU_PLATFORM_ENV)
        if config.actor_rollout_ref.rollout.name == "vllm":
            env.update(_vllm_cpu_env(config))
    elif recipe.kernels == "project" and recipe.deterministic and config.actor_rollout_ref.rollout.name == "vllm":
        env.update(_rollout_vocab_env(config))  # kernels=project on a device: written, not run on a device
    updates = determinism_env.config_updates(plan)
    updates.update({f"{determinism_env.ENV_PATH}.{key}": value for key, value in env.items()})
    with open_dict(config):
        for path, value in updates.items():
            OmegaConf.update(config, path, value, force_add=True)

    result = contract.build_contract(config, plan=plan)
    mismatches = contract.compare(result)
    if mismatches and not recipe.allow_contract_mismatch:
        lines = "\n".join(f"  - {mismatch}" for mismatch in mismatches)
        raise ConfigError(
            "training and rollout are not pinned identically, so log-probs cannot match bitwise:\n"
            f"{lines}\nFix the config, or launch anyway with true_on_policy.allow_contract_mismatch=true."
        )
    for mismatch in mismatches:
        logger.warning("true_on_policy: contract mismatch allowed by config: %s", mismatch)
    refuse_unverified(result, recipe.accept_unverified)
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


def refuse_unverified(result, accepted) -> None:
    """Raise unless every contract row that cannot be verified is named in ``accept_unverified``."""
    from true_on_policy.contract import consistency as contract

    fields = {row.field for row in result.rows}
    unknown = sorted(set(accepted) - fields)
    if unknown:
        raise ConfigError(f"true_on_policy.accept_unverified={unknown}: not contract rows; rows are {sorted(fields)}")
    open_rows = [(row, reason) for row, reason in contract.unverified(result) if row.field not in accepted]
    if open_rows:
        lines = "\n".join(f"  - {row.field}: {reason}" for row, reason in open_rows)
        names = ", ".join(row.field for row, _ in open_rows)
        raise ConfigError(
            "contract rows that cannot be verified for this stack (consistent where visible):\n"
            f"{lines}\nLaunch anyway only by naming them: true_on_policy.accept_unverified=[{names}]."
        )
    for row, reason in contract.unverified(result):
        logger.warning("true_on_policy: unverified contract row accepted by config: %s: %s", row.field, reason)


def launch_hook(config) -> None:
    """What the wrapped ``auto_set_device`` runs first: inert without the section.

    A bad config (:class:`ConfigError`, or a ValueError the pure core raises for a bad value) exits
    with status 2 and one message naming key and value, before Ray starts; any other exception is
    reported as an internal error of true_on_policy and re-raised.
    """
    if recipe_section(config) is None:
        return
    try:
        env = prepare_launch(config)
    except ValueError as error:
        sys.stderr.write(f"true_on_policy: invalid config (nothing was started):\n{error}\n")
        raise SystemExit(EXIT_CONFIG_ERROR) from error
    except Exception:
        sys.stderr.write(
            "true_on_policy: INTERNAL ERROR while preparing the launch (a bug in true_on_policy, not in your "
            "config); please report it with the traceback below.\n"
        )
        raise
    if env.get("VERL_PLATFORM") == "cpu":
        _select_cpu_platform()


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
    if recipe_section(config) is not None:
        return True
    from omegaconf import OmegaConf

    from true_on_policy.verl_adapter.flashreinforce_registration import NAME

    return NAME in (
        OmegaConf.select(config, "algorithm.adv_estimator", default=None),
        OmegaConf.select(config, "actor_rollout_ref.actor.policy_loss.loss_mode", default=None),
    )


def trainer_start_check(config) -> None:
    """At verl's trainer start: a config that uses the recipe needs the settings the launch exported."""
    if settings_module.current() is not None or not uses_recipe(config):
        return
    reason = (
        f"The hook could not be installed: {launch_hook_error}"
        if launch_hook_error
        else "Was the run started by an entry point that does not call verl.utils.device.auto_set_device(config) "
        "before ray.init (as python -m verl.trainer.main_ppo does), or did verl stop calling it?"
    )
    raise settings_module.SettingsNotExported(
        "true_on_policy: the true_on_policy launch hook did not run, so the true_on_policy: section was never "
        "validated and no invariants, determinism plan or consistency contract were applied; refusing to start "
        f"the trainer. {reason}"
    )


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
    from true_on_policy.verl_adapter import resume, trainer_hooks

    if os.environ.get(IN_PROCESS_ENV):
        determinism_env.run_in_process_calls(recipe.platform, json.loads(os.environ[IN_PROCESS_ENV]))
    trainer_hooks.install()
    resume.install()
    if recipe.platform == "cpu":
        # The project's kernels are the CPU reference path; on Ascend and CUDA the determinism
        # plan's vendor settings (exported above) pin the engines' own kernels instead (kernels: engine).
        from true_on_policy.verl_adapter import consistent_training, cpu_platform

        cpu_platform.activate()
        consistent_training.activate(recipe.deterministic)
    elif recipe.kernels == "project" and recipe.deterministic:
        # kernels=project on a device platform (the plan admits only cuda + fsdp): the training side
        # runs the HF model on the project's kernels, as the vLLM plugin does in the rollout.
        # Written, not run on a device.
        from true_on_policy.verl_adapter import consistent_training

        consistent_training.activate(True)
    return recipe
