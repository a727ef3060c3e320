"""verl's real trainer, sharded on both sides: 2 FSDP training ranks, vLLM-CPU's rollout at TP 2.

``configs/cpu_tiny_vllm_tp2.yaml`` (dense, rollout TP 2) and ``configs/cpu_tiny_moe_vllm_ep2.yaml``
(MoE, rollout TP 2 with expert parallelism), each with ``trainer.n_gpus_per_node=2``. The training
forward is unsharded (FSDP shards parameters, not the math), the rollout is TP-sharded: verl's own
``training/rollout_probs_diff_max`` (its recompute against vLLM's recorded sampling log-probs, after
the step's weight sync) is exactly 0.0 at every step with the flag on, on checkpoints of other
shapes than the shipped tiny models passed by ``actor_rollout_ref.model.path`` (which the shipped
tiny models' runs would repeat in smaller form). The flag-off twin at TP 2 is shown at the engine
(tests/test_vllm_tensor_parallel.py: the dense flag-off engine at TP 2 differs; the flag-off MoE + EP
engine cannot run: vLLM-CPU's stock fused-MoE kernel crashes there); the end-to-end flag-off twin is
one launch for all vLLM configs (tests/test_vllm_e2e_trainer.py). One verl launch per configuration.
"""

import other_checkpoints
import pytest

from verl_run import run_trainer

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

STEPS = 2
RUNS = {  # name: (config, checkpoint builder)
    "dense-tp2-other-checkpoint": ("cpu_tiny_vllm_tp2", other_checkpoints.dense_checkpoint),
    "moe-ep2-other-checkpoint": ("cpu_tiny_moe_vllm_ep2", other_checkpoints.moe_checkpoint),
}


def _steps(config: str, scratch, *overrides: str):
    return run_trainer(config, f"trainer.total_training_steps={STEPS}", *overrides, timeout=2400,
                       metrics_path=scratch / "metrics.jsonl")


@pytest.fixture(scope="module", params=list(RUNS))
def run(request, tmp_path_factory):
    config, checkpoint = RUNS[request.param]
    scratch = tmp_path_factory.mktemp(request.param)
    return _steps(config, scratch, f"actor_rollout_ref.model.path={checkpoint(scratch / 'checkpoint')}")


def _diffs(steps) -> dict[int, float]:
    assert sorted(steps) == list(range(1, STEPS + 1))
    diffs = {step: metrics["training/rollout_probs_diff_max"] for step, metrics in steps.items()}
    print(f"training/rollout_probs_diff_max per step: {diffs}")
    return diffs


def test_rollout_probs_diff_is_zero_at_every_step(run):
    _, steps = run
    assert all(diff == 0.0 for diff in _diffs(steps).values())


def test_the_rollout_ran_on_two_vllm_workers(run, request):
    """The adapter's line from each vLLM worker: TP rank 1 of 2 exists, with EP 2 for the MoE config."""
    log, _ = run
    ep = 2 if "moe" in request.node.callspec.id else 1
    assert f"verified on the consistent kernels: TP rank 1/2, EP {ep}" in log, log[-3000:]

