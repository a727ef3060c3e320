"""The Ascend and CUDA launch paths, exercised on this CPU machine as far as they go.

What runs here, with real objects: the verdict for a device config on a machine that *is* that
device (a :class:`Machine` value: what :func:`detect_machine` returns there), the launch applying it
(config and worker environment), and a worker process activating the exported settings -- the one
kernel switch (``Settings.consistent_kernels``) on the training side and in the vLLM plugin, and the
plan's in-process call. What cannot run here (no NPU/GPU): the device kernels themselves, torch_npu
(the Ascend in-process call stops at its import, below), vllm-ascend, MindSpeed, NCCL/HCCL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from true_on_policy.cli.check import compose_config
from true_on_policy.config.platform import Machine
from true_on_policy.config.settings import ENV_VAR, Settings
from true_on_policy.contract import consistency
from true_on_policy.contract.verdict import EXIT_OK, EXIT_UNVERIFIED, decide

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
GPU = Machine("cuda", "torch.cuda.is_available() with 1 GPU(s)")
NPU = Machine("ascend", "torch_npu is installed and sees 16 NPU(s)")

# A worker process: importing verl loads the plugin, which activates the exported settings.
WORKER = """
import json, sys
import torch
import verl  # noqa: F401 - loads the true_on_policy plugin: launch.activate_from_environment()
from true_on_policy.config import settings
from true_on_policy.kernels import ops
from true_on_policy.vllm_adapter import plugin
print(json.dumps({
    "platform": settings.current().platform,
    "consistent_kernels": ops.enabled(),
    "vllm_patch_set": plugin.patch_set(settings.current()),
    "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
}))
"""


def _accepted(config_name, machine, *overrides):
    """The launch's verdict for ``config_name`` on ``machine``, every unverified row accepted by name."""
    cfg = compose_config(str(CONFIGS), config_name, list(overrides))
    first = decide(cfg, machine=machine, launching=True, detected={"vllm": "0.28.0"} if machine is GPU else {})
    assert first.code == EXIT_UNVERIFIED, first.text  # nothing on a device is verified unrun
    rows = sorted(row.field for row, _ in consistency.unverified(first.contract))
    cfg = compose_config(str(CONFIGS), config_name, [*overrides, f"true_on_policy.accept_unverified=[{','.join(rows)}]"])
    verdict = decide(cfg, machine=machine, launching=True, detected={"vllm": "0.28.0"} if machine is GPU else {})
    assert verdict.code == EXIT_OK, verdict.text
    return cfg, verdict


def _worker(env):
    result = subprocess.run(
        [sys.executable, "-c", WORKER], env={**_base_env(), **env}, capture_output=True, text=True, timeout=300, cwd=REPO
    )
    return result


def _base_env():
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("TRUE_ON_POLICY_")}


@pytest.mark.parametrize(("kernels", "switched_on"), [("project", True), ("engine", False)])
@pytest.mark.subprocess
def test_cuda_fsdp_vllm_on_a_gpu_machine_activates_one_kernel_switch(kernels, switched_on):
    """``kernels: project`` (written, not run on a device): the training side's kernels and the vLLM
    plugin's patch set both follow ``Settings.consistent_kernels``; the twin (``kernels: engine``) leaves
    both engines' own kernels (the plan pins vLLM's batch invariance instead)."""
    from true_on_policy.verl_adapter import launch

    # kernels=engine on this FSDP config leaves the attention unpinned in training: a mismatch, allowed here
    cfg, verdict = _accepted(
        "cuda_tiny_moe_vllm_project", GPU, f"true_on_policy.kernels={kernels}",
        *(["true_on_policy.allow_contract_mismatch=true"] if kernels == "engine" else []),
    )
    env = launch.apply_verdict(cfg, verdict)
    assert Settings.from_json(env[ENV_VAR]).consistent_kernels is switched_on
    assert (cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend == "CUSTOM") is switched_on
    assert ("VLLM_BATCH_INVARIANT" in env) is not switched_on
    worker = _worker(env)
    assert worker.returncode == 0, worker.stderr[-3000:]
    state = json.loads(worker.stdout.strip().splitlines()[-1])
    assert state["platform"] == "cuda"
    assert state["consistent_kernels"] is switched_on
    assert state["vllm_patch_set"] == ("cuda" if switched_on else None)


@pytest.mark.subprocess
def test_cuda_megatron_plan_reaches_a_worker_as_env_and_in_process_determinism():
    from true_on_policy.verl_adapter import launch

    cfg, verdict = _accepted("qwen3_30b_a3b_cuda", GPU)
    env = launch.apply_verdict(cfg, verdict)
    assert env["VLLM_BATCH_INVARIANT"] == "1" and env["NCCL_PROTO"] == "Simple"
    assert cfg.actor_rollout_ref.actor.megatron.override_transformer_config.batch_invariant_mode is True
    worker = _worker(env)
    assert worker.returncode == 0, worker.stderr[-3000:]
    state = json.loads(worker.stdout.strip().splitlines()[-1])
    assert state == {"platform": "cuda", "consistent_kernels": False, "vllm_patch_set": None, "deterministic_algorithms": True}


@pytest.mark.subprocess
def test_ascend_plan_reaches_a_worker_and_stops_at_torch_npu_here():
    """The Ascend launch applies on CPU; its worker's in-process call needs torch_npu, which this
    machine lacks: the process fails naming it (written, not run)."""
    from true_on_policy.verl_adapter import launch

    cfg, verdict = _accepted("qwen3_30b_a3b_ascend", NPU)
    env = launch.apply_verdict(cfg, verdict)
    assert env["HCCL_DETERMINISTIC"] and env["VLLM_BATCH_INVARIANT"] == "1"
    worker = _worker(env)
    assert worker.returncode != 0 and "torch_npu" in worker.stderr
