"""Run verl's real trainer (``python -m verl.trainer.main_ppo``) in a subprocess and read its metrics.

verl's console logger prints one line per step: ``step:N - key:value - key:value ...``.
"""

from __future__ import annotations

import json
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


# ---------------------------------------------------------------- verl's file logger (JSONL), checkpoints
def trainer_command(config_name: str, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        f"--config-path={REPO / 'configs'}",
        f"--config-name={config_name}",
        "trainer.logger=[console,file]",
        *overrides,
    ]


def trainer_env(metrics_path: Path) -> dict[str, str]:
    """The environment of a run whose file logger writes to ``metrics_path`` (verl/utils/tracking.py)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1", "VERL_FILE_LOGGER_PATH": str(metrics_path)}


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
