"""The consistency contract's tests that run a fresh Python: the check CLI, the import probes that keep the
contract torch- and verl-free, and the 30B-A3B example's dry run (the in-process ones: tests/unit/test_contract.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from true_on_policy.kernels.scope import KERNEL_DTYPES

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
ASCEND = "qwen3_30b_a3b_ascend"


def _check_args(name, *overrides):
    return ["--config-path", str(CONFIGS), "--config-name", name, *overrides]


@pytest.mark.subprocess
def test_check_cli_as_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "true_on_policy", "check", *_check_args(ASCEND)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    assert "UNVERIFIED" in proc.stderr and "consistent where visible" in proc.stderr
    assert "true-on-policy contract" in proc.stdout


@pytest.mark.subprocess
def test_the_contract_names_the_dtypes_the_kernels_compute_in_without_importing_torch():
    """The contract's [kernel_dtype] row and the kernels' DTYPES read one list (kernels/scope.py), which
    keeps the contract, the plan and the verdict torch-free (check runs before any engine)."""
    from true_on_policy.kernels import ops

    assert tuple(ops.DTYPES) == KERNEL_DTYPES
    probe = "import sys, true_on_policy.contract.verdict, true_on_policy.contract.consistency; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split() == ["False"]


@pytest.mark.subprocess
def test_contract_module_does_not_import_verl():
    code = "import sys; sys.path.insert(0, 'tests/support'); import true_on_policy.contract.consistency; from contract_helpers import plan_of; " \
           "v = {'vllm-ascend': 'main', 'mindspeed': '0.16.0', 'vllm': '0.24.0', 'megatron-core': '0.16.0'}; " \
           "plan_of(True, 'ascend', versions=v, training_strategy='megatron', rollout_name='vllm'); plan_of(True, 'cuda', versions=v, importer=lambda n: 1/0, training_strategy='megatron', rollout_name='vllm'); " \
           "print(sorted(m for m in sys.modules if m.split('.')[0] in ('verl','torch','torch_npu','vllm','vllm_ascend')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.subprocess
def test_example_dry_run_prints_config_table_and_command(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PLATFORM": "ascend", "NNODES": "2", "HOME": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(REPO / "examples" / "qwen3_30b_a3b" / "run_qwen3_30b_a3b.sh"), "--dry-run"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 3 and "cannot be verified" in proc.stderr
    assert "# resolved config" in out and "expert_model_parallel_size: 16" in out
    assert "true-on-policy contract" in out and "consistent where visible" in proc.stderr
    command = out.split("# launch command", 1)[1].strip().splitlines()[0]
    assert "-m verl.trainer.main_ppo" in command
    assert "--config-path=pkg://true_on_policy.configs" in command and f"--config-name={ASCEND}" in command
    assert "HCCL_DETERMINISTIC" in command and "rl_config.enabled=true" in command
    assert "nnodes: 2" in out
