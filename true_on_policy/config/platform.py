"""Which platform this machine is, and why: the value ``true_on_policy.platform: auto`` resolves to.

Detected, never assumed: ``torch_npu`` importable with an NPU -> ``ascend``; CUDA available ->
``cuda``; otherwise ``cpu``. :class:`Machine` carries the answer and the reason the verdict logs.
The verdict (:mod:`true_on_policy.contract.verdict`) compares it with an explicit platform: the
launch refuses a mismatch; ``check`` evaluates the config's declared platform and says it was not
detected here (so a device config can be checked on a CPU machine). No verl import.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from true_on_policy.config.platforms import ASCEND, CPU, CUDA, Platform


@dataclasses.dataclass(frozen=True)
class Machine:
    platform: Platform  # CPU | ASCEND | CUDA (true_on_policy.config.platforms)
    reason: str  # what was found, in words


def detect_machine() -> Machine:
    """The platform of this process's machine (imports torch; torch_npu only when it is installed)."""
    import torch

    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401 - registers torch.npu

            count = torch.npu.device_count() if torch.npu.is_available() else 0
        except Exception as error:  # noqa: BLE001 - a broken torch_npu is not an NPU: say why
            count, broken = 0, f" (torch_npu fails to load: {type(error).__name__}: {error})"
        else:
            broken = ""
        if count:
            return Machine(ASCEND, f"torch_npu is installed and sees {count} NPU(s)")
        npu_note = f"torch_npu is installed but sees no NPU{broken}; "
    else:
        npu_note = "torch_npu is not installed; "
    if torch.cuda.is_available():
        return Machine(CUDA, f"{npu_note}torch.cuda.is_available() with {torch.cuda.device_count()} GPU(s)")
    return Machine(CPU, f"{npu_note}torch.cuda.is_available() is False")
