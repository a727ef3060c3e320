"""verl's patched internals in verl's real trainer: a run whose launch hook did not run fails at trainer start
(the patch list and each target's check: tests/unit/test_patches.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from true_on_policy.config.settings import ENV_VAR
from verl_run import NO_DASHBOARD_OVERRIDE

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_a_run_whose_launch_hook_did_not_run_fails_at_trainer_start(tmp_path):
    """verl's launch stops calling the hooked ``auto_set_device`` (a rename in verl): Ray starts, and the
    trainer refuses to start, saying why; with the hook in place the same config trains (other e2e tests)."""
    code = (
        "import sys\n"
        "from verl.trainer import main_ppo\n"
        "from true_on_policy import patching\n"
        "assert patching.is_replacement(main_ppo.auto_set_device)\n"
        "main_ppo.auto_set_device = main_ppo.auto_set_device.__wrapped__  # the launch calls verl's own function\n"
        f"sys.argv = ['main_ppo', '--config-path={REPO / 'configs'}', '--config-name=cpu_tiny',\n"
        f"            'trainer.total_training_steps=1', '{NO_DASHBOARD_OVERRIDE}', 'hydra.run.dir={tmp_path}']\n"
        "main_ppo.main()\n"
    )
    env = {key: value for key, value in os.environ.items() if key != ENV_VAR}
    env.update(PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode != 0, log[-4000:]
    assert "the true_on_policy launch hook did not run" in log, log[-4000:]
    assert "ray init kwargs" in log  # it got as far as Ray: the trainer-start check caught it
    assert "step:1" not in log  # and not one step ran
