"""The ``true_on_policy:`` section through the real launch: ``python -m verl.trainer.main_ppo`` with a bad value
exits 2 before Ray, naming key and value (the schema and the in-process checks: tests/unit/test_settings.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


@pytest.mark.parametrize(
    ("config_name", "override", "message"),
    [
        ("cpu_tiny", "true_on_policy.deterministic=maybe", "true_on_policy.deterministic must be a bool, got 'maybe'"),
        ("qwen3_30b_a3b_ascend", "true_on_policy.delta=-1", "true_on_policy.delta must be a number >= 0"),
    ],
)
@pytest.mark.subprocess
def test_main_ppo_exits_2_before_ray_naming_key_and_value(config_name, override, message, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={CONFIGS}", f"--config-name={config_name}", override,
         f"hydra.run.dir={tmp_path}"],  # Hydra's run folder, which it creates before the task runs
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 2, log[-3000:]
    assert message in result.stderr and "refused (nothing was started)" in result.stderr
    assert "ray init kwargs" not in log and "Traceback" not in log  # main_ppo prints the former just before ray.init
