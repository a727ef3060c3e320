"""Run verl's real trainer (``python -m verl.trainer.main_ppo``) in a subprocess and read its metrics.

Metrics come from verl's file logger (``trainer.logger=[console,file]``, verl/utils/tracking.py
``FileLogger``): one JSON object per ``Tracking.log`` call, ``{"step": N, "data": {metric: value}}``,
written to ``$VERL_FILE_LOGGER_PATH``. Console text is kept only for failure messages.
"""

from __future__ import annotations

import json
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
        command = trainer_command(config_name, *overrides)
        result = subprocess.run(command, cwd=REPO, env=trainer_env(path), capture_output=True, text=True, timeout=timeout)
        log = result.stdout + result.stderr
        if result.returncode != 0:
            raise AssertionError(f"trainer exited {result.returncode}; command: {' '.join(command)}\n{log[-6000:]}")
        if not path.exists():
            raise AssertionError(f"trainer wrote no metrics file at {path}; command: {' '.join(command)}\n{log[-3000:]}")
        return log, read_step_metrics(path)


# ---------------------------------------------------------------- verl's file logger (JSONL), checkpoints
def trainer_command(config_name: str, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        f"--config-path={REPO / 'configs'}",
        f"--config-name={config_name}",
        LOGGER_OVERRIDE,
        *overrides,
    ]


def trainer_env(metrics_path: Path) -> dict[str, str]:
    """The environment of a run whose file logger writes to ``metrics_path`` (verl/utils/tracking.py)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1", FILE_LOGGER_PATH_ENV: str(metrics_path)}


def read_file_logger(path: Path) -> dict[int, dict]:
    """``{step: metrics}`` from verl's FileLogger JSONL (one ``{"step": N, "data": {...}}`` per line)."""
    steps: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(int(record["step"]), {}).update(record["data"])
    return steps


def run_logged(config_name: str, metrics_path: Path, *overrides: str, timeout: int = 900) -> dict[int, dict]:
    """Run the trainer to completion with the file logger at ``metrics_path``; its metrics per step."""
    command = trainer_command(config_name, *overrides)
    result = subprocess.run(
        command, cwd=REPO, env=trainer_env(metrics_path), capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        log = result.stdout + result.stderr
        raise AssertionError(f"trainer exited {result.returncode}; command: {' '.join(command)}\n{log[-6000:]}")
    return read_file_logger(metrics_path)


def latest_checkpoint(checkpoint_dir: Path) -> int | None:
    """The step verl's tracker (latest_checkpointed_iteration.txt) names, or None."""
    tracker = Path(checkpoint_dir) / "latest_checkpointed_iteration.txt"
    try:
        text = tracker.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def actor_weights(step_dir: Path) -> dict:
    """The actor's model state dict from a ``global_step_N`` folder (one FSDP rank)."""
    import torch

    state = torch.load(Path(step_dir) / "actor" / "model_world_size_1_rank_0.pt", weights_only=False, map_location="cpu")
    return {name: (value.to_local() if hasattr(value, "to_local") else value) for name, value in state.items()}
