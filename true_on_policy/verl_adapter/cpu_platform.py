"""verl on CPU: a ``cpu`` platform for verl's PlatformRegistry and the two fixes verl 0.9.1 needs.

Registering the platform is inert: auto-detection never picks it (``is_platform_available`` is
False); it is selected only by ``VERL_PLATFORM=cpu``, which the launch hook sets when the config
says ``true_on_policy.platform: cpu``. :func:`activate` applies the fixes in a process that runs
on that platform:

- the FSDP training engine registers itself only for devices ``cuda``/``npu``: register the same
  classes for ``cpu`` through verl's public ``EngineRegistry.register`` (``VERL_ENGINE_DEVICE=cpu``
  selects them);
- ``initialize_global_process_group_ray`` builds the backend string ``cpu:gloo,cpu:gloo``, which
  torch rejects ("Duplicate device type cpu"): on this platform the process group is plain gloo
  (a patch of verl's internals, in :mod:`true_on_policy.verl_adapter.patches`).

Ray schedules verl's workers on the ``GPU`` resource; a CPU job declares logical GPUs
(``ray_kwargs.ray_init.num_gpus``) as worker slots. They are slots, not devices.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch

from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM_NAME = "cpu"


def _cpu_device_module() -> types.ModuleType:
    """What verl calls through ``get_torch_device()``: torch.cpu plus no-op memory statistics."""
    module = types.ModuleType("true_on_policy_cpu_device")
    for name in ("current_device", "device_count", "is_available", "synchronize", "Stream", "Event", "stream"):
        setattr(module, name, getattr(torch.cpu, name))
    module.current_stream = torch.cpu.current_stream
    module.set_device = lambda device=None: None
    module.empty_cache = lambda: None
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.get_rng_state = lambda device=None: torch.get_rng_state()
    module.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    for stat in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(module, stat, lambda device=None: 0)
    module.reset_peak_memory_stats = lambda device=None: None
    module.mem_get_info = lambda device=None: (0, 0)
    module.is_initialized = lambda: True
    module.get_device_name = lambda device=None: "CPU"  # the key verl's FLOPS table uses for torch.cpu
    return module


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """Host CPU with gloo collectives."""

    _device_module = _cpu_device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # never auto-detected: only VERL_PLATFORM=cpu selects it

    def current_device(self) -> str:
        # verl uses the current device as a torch device (``tensor.to(get_device_id())``).
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # Ray sets it for the logical GPU slots; torch on CPU ignores it

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


@functools.cache
def activate() -> None:
    """Apply the CPU fixes in this process (once: verl's registry refuses a second registration). verl's FSDP
    engines are registered for this platform when their module is imported: the processes that build an engine
    import it, and the others (Ray's many verl actors) do not pay the seconds of datasets, peft and pandas
    behind it."""
    from true_on_policy.verl_adapter import patches

    patches.when_imported(patches.FSDP_ENGINE_MODULE, _register_fsdp_engines)
    patches.install_gloo_process_group()


def _register_fsdp_engines(transformer_impl) -> None:
    from verl.workers.engine.base import EngineRegistry

    for model_type, engine_cls in (
        ("language_model", transformer_impl.FSDPEngineWithLMHead),
        ("value_model", transformer_impl.FSDPEngineWithValueHead),
    ):
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device=PLATFORM_NAME)(engine_cls)
