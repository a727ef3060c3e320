"""Every patch of verl 0.9.1's internals, in one module; each checks its target when installed.

verl has public registries for most of what the recipe adds (``register_policy_loss``,
``register_adv_est``, ``PlatformRegistry``, ``EngineRegistry.register``,
``RolloutReplicaRegistry``, the ``trainer.v1.sampler.custom_sampler`` slot); those are used where
they are defined. What verl offers no hook for is patched here, and only here:

=================================================================  ==========================================
target (:data:`TARGETS`)                                            why
=================================================================  ==========================================
``verl.utils.device.auto_set_device``                               the launch hook: main_ppo's first call,
                                                                    before ``ray.init``
``...v1.trainer_base.PPOTrainer.__init__``                          the trainer-start check: the launch hook ran
``...PPOTrainer._balance_batch``                                    canonical batch order
``...PPOTrainer._compute_old_log_prob``                             behaviour log-probs = recorded ones
``...PPOTrainer._compute_advantage``                                the entropy filter's mask
``...PPOTrainer._add_prompts_to_generate``                          the async sampler reaches the trainer
                                                                    through this bound ``refill_fn``
``...PPOTrainer._save_checkpoint`` / ``_load_checkpoint``           the sampler's prompt ledger rides along
                                                                    in verl's checkpoint (resume.py)
``verl.utils.distributed.initialize_global_process_group_ray``      plain gloo on the CPU platform
``verl.workers.engine.fsdp.transformer_impl.logprobs_from_logits``  the consistent log-softmax (flag on)
``verl.utils.ulysses.get_ulysses_sequence_parallel_group`` (read)   the Ulysses group the training attention
                                                                    and Gated DeltaNet all-to-all over
``verl.workers.rollout.base.get_rollout_class`` / ``_ROLLOUT_REGISTRY``  the worker-side CPU rollout
``...vllm_rollout.ServerAdapter.__init__`` (sender) and             the vLLM weight-sync socket named per
``...vllm_rollout.utils.vLLMColocateWorkerExtension._get_zmq_handle``  launch, not per Ray job id
(receiver)
=================================================================  ==========================================

Each target is a :class:`true_on_policy.patching.Target` in :data:`TARGETS`, with its parameter
names in verl 0.9.1; every patch goes through :func:`true_on_policy.patching.apply`, which checks
it before anything is applied: a missing target or a changed signature raises
:class:`~true_on_policy.patching.PatchTargetChanged` naming the target and what changed, instead of
a patch that silently no longer applies (or applies to something else).
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
import uuid
from collections.abc import Callable
from typing import Any

from true_on_policy import patching
from true_on_policy.config.platforms import VLLM
from true_on_policy.patching import Patch, PatchTargetChanged, Target

VERL_VERSION = "0.9.1"
# The two heavy verl modules patched where they are imported (:func:`when_imported`), not in every process.
TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"
FSDP_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
_TRAINER = f"{TRAINER_MODULE}.PPOTrainer"
_VLLM_SENDER_MODULE = "verl.workers.rollout.vllm_rollout.vllm_rollout"
_VLLM_RECEIVER_MODULE = "verl.workers.rollout.vllm_rollout.utils"


def _target(module: str, attribute: str, expected: tuple[str, ...] | type) -> Target:
    return Target(module, attribute, expected, written_for=f"verl {VERL_VERSION}")


def _trainer_method(name: str, params: tuple[str, ...]) -> Target:
    return _target(TRAINER_MODULE, f"PPOTrainer.{name}", ("self", *params))


# Every verl symbol patched or reached into, with its parameter names in verl 0.9.1 (or its type).
TARGETS: dict[str, Target] = {
    target.name: target
    for target in (
        _target("verl.utils.device", "auto_set_device", ("config",)),
        _trainer_method("__init__", ("config",)),
        _trainer_method("_balance_batch", ("batch", "metrics", "logging_prefix", "keep_minibatch")),
        _trainer_method("_compute_old_log_prob", ("batch", "metrics")),
        _trainer_method("_compute_advantage", ("batch", "metrics")),
        _trainer_method("_add_prompts_to_generate", ("num_prompts",)),
        _trainer_method("_save_checkpoint", ()),
        _trainer_method("_load_checkpoint", ()),
        _target("verl.utils.distributed", "initialize_global_process_group_ray", ("timeout_second", "backend")),
        _target(FSDP_ENGINE_MODULE, "logprobs_from_logits",
                ("logits", "labels", "inplace_backward")),
        _target("verl.utils.ulysses", "get_ulysses_sequence_parallel_group", ()),
        _target("verl.workers.rollout.base", "get_rollout_class", ("rollout_name", "mode")),
        _target("verl.workers.rollout.base", "_ROLLOUT_REGISTRY", dict),
        _target(_VLLM_SENDER_MODULE, "ServerAdapter.__init__",
                ("self", "config", "model_config", "device_mesh", "replica_rank")),
        _target(_VLLM_RECEIVER_MODULE, "vLLMColocateWorkerExtension._get_zmq_handle", ("self",)),
    )
}


def check_target(name: str, found: Any = None) -> Any:
    """Look the target ``name`` (a key of :data:`TARGETS`) up, or take ``found``, and check it;
    returns verl's original (an installed wrapper is checked through the original it wraps)."""
    if name not in TARGETS:
        raise KeyError(f"{name} is not a registered patch target; add it to TARGETS")
    return TARGETS[name].check() if found is None else TARGETS[name].check(found)


def _presented_as(wrapper: Callable, original: Callable) -> Callable:
    """``wrapper`` with verl's name, docstring and attributes (:func:`functools.update_wrapper`)."""
    return functools.update_wrapper(wrapper, original)


# --------------------------------------------------------------------------- the launch hook


def install_launch_hook(hook: Callable[[Any], None], device_module: Any = None) -> None:
    """``auto_set_device(config)`` runs ``hook(config)`` first (idempotent).

    ``python -m verl.trainer.main_ppo`` binds ``auto_set_device`` from ``verl.utils.device`` when
    it is imported, after verl loaded the plugin, so the wrapper reaches the real launch; its call
    comes before ``ray.init``. ``device_module`` is for tests (default ``verl.utils.device``).
    """
    if device_module is None:
        import verl.utils.device as device_module
    if patching.is_replacement(getattr(device_module, "auto_set_device", None)):
        return

    def make(original):
        def auto_set_device(config):
            hook(config)
            return original(config)

        return _presented_as(auto_set_device, original)

    patching.apply([Patch(TARGETS["verl.utils.device.auto_set_device"], make=make, owner=device_module)])


# --------------------------------------------------------------------------- the v1 trainer


def wrap_trainer_method(trainer_cls: type, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``trainer_cls.<name>`` by ``make_wrapper(original)`` after checking verl's original."""

    def make(original):
        return _presented_as(make_wrapper(original), original)

    patching.apply([Patch(TARGETS[f"{_TRAINER}.{name}"], make=make, owner=trainer_cls)])


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module is executed, so a patch of a heavy module does not
    import it in every process that loads the plugin (the trainer module is slow to import)."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[Any], None]]] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        callbacks = self.callbacks.pop(fullname)
        exec_module = spec.loader.exec_module

        def exec_module_then_patch(module):
            exec_module(module)
            for callback in callbacks:
                callback(module)

        spec.loader.exec_module = exec_module_then_patch
        return spec


_after_import = _AfterImport()


def when_imported(module_name: str, callback: Callable[[Any], None]) -> None:
    """``callback(module)`` now if ``module_name`` is imported, else right after its import."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)
    _after_import.callbacks.setdefault(module_name, []).append(callback)


def install_trainer_start_check(check: Callable[[Any], None], trainer_cls: type | None = None) -> None:
    """``PPOTrainer.__init__(self, config)`` runs ``check(config)`` first (idempotent).

    Without ``trainer_cls``, installed on verl's PPOTrainer when ``trainer_base`` is imported.
    """
    if trainer_cls is None:
        when_imported(TRAINER_MODULE, lambda module: install_trainer_start_check(check, module.PPOTrainer))
        return
    if patching.is_replacement(trainer_cls.__init__):
        return

    def make(original):
        def __init__(self, config, *args, **kwargs):
            check(config)
            original(self, config, *args, **kwargs)

        return __init__

    wrap_trainer_method(trainer_cls, "__init__", make)


def trainer_behind_refill_fn(refill_fn: Any) -> Any:
    """The v1 trainer whose bound ``_add_prompts_to_generate`` verl passed as a sampler's ``refill_fn``.

    verl's custom-sampler constructor contract gives no trainer handle; the async sampler needs the
    trainer's agent loop (to re-dispatch a prompt) and dataset (to size an epoch).
    """
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    trainer = getattr(refill_fn, "__self__", None)
    function = getattr(refill_fn, "__func__", None)
    if not isinstance(trainer, PPOTrainer) or getattr(function, "__name__", None) != "_add_prompts_to_generate":
        raise PatchTargetChanged(
            f"{_TRAINER}._add_prompts_to_generate: the sampler's refill_fn={refill_fn!r} is not the bound "
            f"_add_prompts_to_generate of a v1 PPOTrainer, as verl {VERL_VERSION} passes it; the single-rollout "
            "sampler reaches the trainer through it"
        )
    check_target(f"{_TRAINER}._add_prompts_to_generate", function)
    return trainer


# --------------------------------------------------------------------------- the CPU backend


def install_gloo_process_group() -> None:
    """On the CPU platform verl's default backend string is ``cpu:gloo,cpu:gloo``, which torch rejects
    ("Duplicate device type cpu"); the process group becomes plain ``cpu:gloo`` (idempotent)."""
    import verl.utils.distributed as verl_distributed

    target = TARGETS["verl.utils.distributed.initialize_global_process_group_ray"]
    original = verl_distributed.initialize_global_process_group_ray
    if patching.is_replacement(original):
        return

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    patched = _presented_as(initialize_global_process_group_ray, original)
    patches = [Patch(target, patched)]
    # engine_workers binds the name at import: rebind it there when it was imported first.
    engine_workers = sys.modules.get("verl.workers.engine_workers")
    if engine_workers is not None:
        if getattr(engine_workers, "initialize_global_process_group_ray", None) is not original:
            raise PatchTargetChanged(
                "verl.workers.engine_workers.initialize_global_process_group_ray: expected the name bound from "
                f"verl.utils.distributed (verl {VERL_VERSION}), found "
                f"{getattr(engine_workers, 'initialize_global_process_group_ray', None)!r}"
            )
        patches.append(Patch(target, patched, owner=engine_workers))
    patching.apply(patches)


def install_logprobs_from_logits(replacement: Callable) -> None:
    """verl's FSDP engine turns logits into token log-probs with ``logprobs_from_logits``, bound by
    name in ``transformer_impl``; ``replacement`` (same signature) takes its place there."""
    from verl.workers.engine.fsdp import transformer_impl

    target = TARGETS[f"{FSDP_ENGINE_MODULE}.logprobs_from_logits"]
    if patching.is_replacement(transformer_impl.logprobs_from_logits):
        return
    target.check()
    target.check(replacement)
    patching.apply([Patch(target, make=functools.partial(_presented_as, replacement))])


def register_worker_rollout(name: str, mode: str, class_path: str) -> None:
    """Worker-side rollout class for ``rollout.name=<name>``: verl has no register function for
    ``_ROLLOUT_REGISTRY``, which ``get_rollout_class(rollout_name, mode)`` reads."""
    from verl.workers.rollout import base as rollout_base

    check_target("verl.workers.rollout.base.get_rollout_class")
    registry = check_target("verl.workers.rollout.base._ROLLOUT_REGISTRY")
    if (VLLM, "async") not in registry:  # verl's own vLLM rollout: the registry's shape
        raise PatchTargetChanged(
            "verl.workers.rollout.base._ROLLOUT_REGISTRY: expected a dict keyed by (rollout name, mode) as in verl "
            f"{VERL_VERSION}, found no ('vllm', 'async') key among {sorted(registry, key=repr)}"
        )
    existing = registry.get((name, mode))
    if existing not in (None, class_path):
        raise ValueError(f"rollout ({name!r}, {mode!r}) is already registered to {existing}")
    rollout_base._ROLLOUT_REGISTRY[(name, mode)] = class_path


# --------------------------------------------------------------------------- the vLLM weight-sync socket

# The launch's own part of its weight-sync socket paths, exported by the driver to every process.
WEIGHT_SYNC_RUN_ENV = "TRUE_ON_POLICY_WEIGHT_SYNC_RUN"
# verl 0.9.1's weight-sync address: this prefix, then "{ray job id}-replica-{r}-rank-{k}.sock".
WEIGHT_SYNC_SOCKET_PREFIX = "ipc:///tmp/rl-colocate-zmq-"


def weight_sync_run_env() -> dict[str, str]:
    """``{WEIGHT_SYNC_RUN_ENV: "<driver pid>-<random>"}``: a name no other launch on the host has."""
    return {WEIGHT_SYNC_RUN_ENV: f"{os.getpid()}-{uuid.uuid4().hex[:12]}"}


def launch_socket(address: str) -> str:
    """verl's weight-sync socket ``address`` with this launch's name (:data:`WEIGHT_SYNC_RUN_ENV`) in it.

    verl 0.9.1 names the socket by the Ray job id, and every fresh Ray cluster's first job is
    ``01000000``: two launches on one host share the path, and the sender removes the file and binds
    anew at every sync, so overlapping syncs reach the other launch's sender (a hang, or its weights).
    """
    run = os.environ.get(WEIGHT_SYNC_RUN_ENV)
    if not run:
        raise RuntimeError(
            f"{WEIGHT_SYNC_RUN_ENV} is not set in this process (pid {os.getpid()}): the true_on_policy launch "
            "exports it to every process of the run, so its vLLM weight-sync socket cannot be named per launch"
        )
    if not address.startswith(WEIGHT_SYNC_SOCKET_PREFIX):
        raise PatchTargetChanged(
            f"verl's vLLM weight-sync address is {address!r}, not {WEIGHT_SYNC_SOCKET_PREFIX}... as in verl "
            f"{VERL_VERSION}; true_on_policy cannot name it per launch"
        )
    return f"{WEIGHT_SYNC_SOCKET_PREFIX}{run}-{address[len(WEIGHT_SYNC_SOCKET_PREFIX):]}"


def _sender_names_its_socket_per_launch(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.zmq_handle = launch_socket(self.zmq_handle)

    return _presented_as(__init__, original)


def _receiver_names_its_socket_per_launch(original):
    def _get_zmq_handle(self):
        return launch_socket(original(self))

    return _presented_as(_get_zmq_handle, original)


def install_launch_weight_sync_socket() -> None:
    """verl's vLLM weight sync binds and connects :func:`launch_socket` paths: the sender
    (``ServerAdapter``, in a training worker) and the receiver (vLLM's worker extension, in the
    engine's worker) -- each patched when its module is imported (idempotent)."""
    for module_name, attribute, make in (
        (_VLLM_SENDER_MODULE, "ServerAdapter.__init__", _sender_names_its_socket_per_launch),
        (_VLLM_RECEIVER_MODULE, "vLLMColocateWorkerExtension._get_zmq_handle", _receiver_names_its_socket_per_launch),
    ):
        when_imported(module_name, functools.partial(_name_socket_per_launch, attribute, make))


def _name_socket_per_launch(attribute: str, make: Callable, module: Any) -> None:
    owner_name, name = attribute.split(".")
    owner = getattr(module, owner_name)
    if patching.is_replacement(vars(owner).get(name)):
        return
    patching.apply([Patch(TARGETS[f"{module.__name__}.{attribute}"], make=make, owner=owner)])
