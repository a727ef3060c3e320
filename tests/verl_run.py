"""Run verl's real trainer (``python -m verl.trainer.main_ppo``) in a subprocess and read its metrics.

Metrics come from verl's file logger (``trainer.logger=[console,file]``, verl/utils/tracking.py
``FileLogger``): one JSON object per ``Tracking.log`` call, ``{"step": N, "data": {metric: value}}``,
written to ``$VERL_FILE_LOGGER_PATH``. Console text is kept only for failure messages.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from true_on_policy.cli.plot_metrics import read_step_metrics

REPO = Path(__file__).resolve().parents[1]
FILE_LOGGER_PATH_ENV = "VERL_FILE_LOGGER_PATH"  # read by verl.utils.tracking.FileLogger
LOGGER_OVERRIDE = "trainer.logger=[console,file]"


def run_trainer(
    config_name: str, *overrides: str, timeout: int = 900, metrics_path: Path | None = None
) -> tuple[str, dict[int, dict[str, float]]]:
    """Run the trainer to completion and return (console log, per-step metrics from the JSONL file).

    Fails with the log's tail if the trainer does not exit cleanly or wrote no metrics file.
    """
    with tempfile.TemporaryDirectory(prefix="verl_run_") as scratch:
        path = Path(metrics_path) if metrics_path is not None else Path(scratch) / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1", FILE_LOGGER_PATH_ENV: str(path)}
        command = [
            sys.executable,
            "-m",
            "verl.trainer.main_ppo",
            f"--config-path={REPO / 'configs'}",
            f"--config-name={config_name}",
            LOGGER_OVERRIDE,
            *overrides,
        ]
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        log = result.stdout + result.stderr
        if result.returncode != 0:
            raise AssertionError(f"trainer exited {result.returncode}; command: {' '.join(command)}\n{log[-6000:]}")
        if not path.exists():
            raise AssertionError(f"trainer wrote no metrics file at {path}; command: {' '.join(command)}\n{log[-3000:]}")
        return log, read_step_metrics(path)
