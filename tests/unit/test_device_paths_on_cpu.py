"""The Ascend and CUDA machine detection on this CPU machine: what :func:`detect_machine` sees and how
``auto`` resolves (the launch paths, run in worker processes: tests/engine/test_device_paths_on_cpu_engine.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from true_on_policy.cli.check import compose_config
from true_on_policy.config.platform import Machine, detect_machine
from true_on_policy.config.settings import Settings
from true_on_policy.contract.verdict import decide

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
GPU = Machine("cuda", "torch.cuda.is_available() with 1 GPU(s)")


def test_this_machine_is_detected_as_what_torch_sees_and_says_why():
    """True on a machine with a GPU too: the detection follows torch.cuda (no torch_npu installed here)."""
    import torch

    machine = detect_machine()
    assert "torch_npu" in machine.reason
    if torch.cuda.is_available():
        assert machine.platform == "cuda"
        assert f"torch.cuda.is_available() with {torch.cuda.device_count()} GPU(s)" in machine.reason
    else:
        assert machine.platform == "cpu"
        assert "torch.cuda.is_available() is False" in machine.reason


def test_auto_resolves_to_the_machine_and_is_never_exported_unresolved():
    with pytest.raises(ValueError, match="resolved platform"):
        Settings().to_json()
    cfg = compose_config(str(CONFIGS), "cuda_tiny_moe_vllm_project", ["true_on_policy.platform=auto"])
    verdict = decide(cfg, machine=GPU, launching=True, detected={"vllm": "0.28.0"})
    assert verdict.settings.platform == "cuda" and "platform=auto detected cuda" in verdict.text
