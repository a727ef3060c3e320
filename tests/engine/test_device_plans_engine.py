"""The CUDA device check script on a CPU machine, run in a fresh process: it stops at the GPU step (the plans
themselves: tests/unit/test_device_plans.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.subprocess
def test_device_check_script_stops_where_it_needs_a_gpu(tmp_path):
    """On a CPU machine the CUDA device check runs up to the GPU step, then says so (exit 4)."""
    import os
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script runs through (tests/engine/test_device_check_engine.py)")
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    env.pop("DEVICE", None)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "device_check_cuda.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr
    assert proc.stdout.startswith("torch ") and "needs a CUDA GPU" in proc.stderr
    assert not (tmp_path / "device_check_cuda.json").exists()
