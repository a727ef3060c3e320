"""The CUDA device check's script, run on CPU in a fresh process (no GPU here; its python part in-process:
tests/unit/test_device_check.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.subprocess
def test_device_check_script_writes_json(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "PROMPTS": "2", "LONGEST": "8", "NEW_TOKENS": "2", "REPEATS": "1",
           "MICRO_BATCH": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "device_check_cuda.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = json.loads((tmp_path / "device_check_cuda.json").read_text())
    assert records[0]["case"] == "environment" and "logdiff/moe/bfloat16" in proc.stdout
