"""examples/: the toy update runs in seconds and learns; every run script's --dry-run prints the
launch's verdict and the exact command it would run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.subprocess
def test_toy_update_raises_the_reward_with_every_trajectory_admitted(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "toy_update.py"), "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    history = json.loads(proc.stdout)
    rewards = [record["reward"] for record in history]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, rewards
    # one optimizer step per freshly sampled batch: current == recorded log-probs, every row admitted
    assert {record["acceptance_rate"] for record in history} == {1.0}


@pytest.mark.subprocess
def test_cpu_tiny_dry_run_prints_the_verdict_and_the_launch_command(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(REPO / "examples" / "cpu_tiny" / "run_cpu_tiny.sh"), "--dry-run", "cpu_tiny_moe", "trainer.total_training_steps=3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "true_on_policy: launch accepted (consistent and verified" in proc.stderr
    command = proc.stdout.split("# launch command", 1)[1].strip().splitlines()[0]
    assert command == (
        f"{sys.executable} -m verl.trainer.main_ppo --config-path=pkg://true_on_policy.configs "
        "--config-name=cpu_tiny_moe trainer.total_training_steps=3"
    )


@pytest.mark.subprocess
def test_qwen35_35b_a3b_dry_run_prints_the_verdict_and_the_launch_command(tmp_path):
    """Without MODEL_PATH the dry run reads the shipped shapes and says so; exit 3 naming the rows no device run has
    established (gdn_forward among them), then the exact launch command. Twin: the launch without MODEL_PATH is
    refused before anything starts (a launch needs the text model's weights)."""
    env = {key: value for key, value in os.environ.items() if key != "MODEL_PATH"} | {"PYTHON": sys.executable}
    script = str(REPO / "examples" / "qwen35_35b_a3b" / "run_qwen35_35b_a3b.sh")
    proc = subprocess.run(["bash", script, "--dry-run"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert "MODEL_PATH=<unset: the shipped shapes" in proc.stdout
    assert "[gdn_forward]" in proc.stderr and "true_on_policy.accept_unverified=[" in proc.stderr
    assert "shapes/qwen35_35b_a3b" in proc.stdout and "ulysses_sequence_parallel_size: 4" in proc.stdout
    command = proc.stdout.split("# launch command", 1)[1].strip().splitlines()[0]
    assert command.startswith(f"{sys.executable} -m verl.trainer.main_ppo --config-path=pkg://true_on_policy.configs "
                              "--config-name=qwen35_35b_a3b_cuda")
    launch = subprocess.run(["bash", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert launch.returncode == 64 and "MODEL_PATH must name a local checkpoint of the text model" in launch.stderr
