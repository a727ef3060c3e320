"""verl's real trainer, sharded on both sides: 2 FSDP training ranks, vLLM-CPU's rollout at TP 2 with EP 2.

``configs/cpu_tiny_moe_vllm_ep2.yaml`` (rollout TP 2 with expert parallelism, ``trainer.n_gpus_per_node=2``)
on a Qwen3-MoE checkpoint of another shape, passed by ``actor_rollout_ref.model.path``, whose layer 1 is
dense (``mlp_only_layers``): one launch shards what a dense model's TP 2 shards -- attention (QKV by
heads, the output projection's all-reduce), a dense MLP (gate/up by columns, down by rows), the
vocabulary-parallel embedding and head -- and the experts over the EP ranks. The training forward is
unsharded (FSDP shards parameters, not the math): verl's own ``training/rollout_probs_diff_max`` (its
recompute against vLLM's recorded sampling log-probs, after the step's weight sync) is exactly 0.0 at
every step with the flag on. ``configs/cpu_tiny_vllm_tp2.yaml`` (dense, TP 2 without EP) is not launched
again here: the same sharded layers, in a smaller model, are the dense half of this run; its engine at
TP 2, flag on and its flag-off twin, is tests/test_vllm_tensor_parallel.py (the flag-off MoE + EP engine
cannot run: vLLM-CPU's stock fused-MoE kernel crashes there); the end-to-end flag-off twin is one launch
for all vLLM configs (tests/test_vllm_e2e_trainer.py).
"""

import other_checkpoints
import pytest

from verl_run import run_trainer

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

STEPS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``cpu_tiny_moe_vllm_ep2`` on the other-shape MoE checkpoint: (console log, metrics per step)."""
    scratch = tmp_path_factory.mktemp("moe-ep2-other-checkpoint")
    checkpoint = other_checkpoints.moe_checkpoint(scratch / "checkpoint")
    return run_trainer("cpu_tiny_moe_vllm_ep2", f"trainer.total_training_steps={STEPS}",
                       f"actor_rollout_ref.model.path={checkpoint}", timeout=2400, metrics_path=scratch / "metrics.jsonl")


def test_rollout_probs_diff_is_zero_at_every_step(run):
    _, steps = run
    assert sorted(steps) == list(range(1, STEPS + 1))
    diffs = {step: metrics["training/rollout_probs_diff_max"] for step, metrics in steps.items()}
    print(f"training/rollout_probs_diff_max per step: {diffs}")
    assert all(diff == 0.0 for diff in diffs.values())


def test_the_rollout_ran_on_two_vllm_workers(run):
    """The adapter's line from each vLLM worker: TP rank 1 of 2 exists, with EP 2."""
    log, _ = run
    assert "verified on the consistent kernels: TP rank 1/2, EP 2" in log, log[-3000:]
