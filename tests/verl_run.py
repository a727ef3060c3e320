"""Run verl's real trainer (``python -m verl.trainer.main_ppo``) in a subprocess and read its metrics.

verl's console logger prints one line per step: ``step:N - key:value - key:value ...``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_STEP_LINE = re.compile(r"step:(\d+) - (.*)$")
_NUMBER = re.compile(r"^(?:np\.\w+\()?(-?[0-9.]+(?:e[-+]?\d+)?|nan|inf|-inf)\)?$")


def parse_step_metrics(log: str) -> dict[int, dict[str, float]]:
    """``{step: {metric: value}}`` from verl's console lines (non-numeric values are skipped)."""
    steps: dict[int, dict[str, float]] = {}
    for line in log.splitlines():
        match = _STEP_LINE.search(line)
        if not match:
            continue
        metrics = steps.setdefault(int(match.group(1)), {})
        for item in match.group(2).split(" - "):
            key, _, value = item.rpartition(":")
            number = _NUMBER.match(value.strip())
            if key and number:
                metrics[key.strip()] = float(number.group(1))
    return steps


def run_trainer(config_name: str, *overrides: str, timeout: int = 900) -> tuple[str, dict[int, dict[str, float]]]:
    """Run the trainer to completion; fail with the log's tail if it does not exit cleanly."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}
    command = [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        f"--config-path={REPO / 'configs'}",
        f"--config-name={config_name}",
        *overrides,
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    log = result.stdout + result.stderr
    if result.returncode != 0:
        raise AssertionError(f"trainer exited {result.returncode}; command: {' '.join(command)}\n{log[-6000:]}")
    return log, parse_step_metrics(log)
