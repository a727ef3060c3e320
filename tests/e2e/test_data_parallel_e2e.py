"""FlashREINFORCE across data-parallel ranks, in verl's real trainer: DP = 1 and DP = 2 train on the same batch alike.

``cpu_tiny`` with ``trainer.n_gpus_per_node=1`` (the shared ``CPU_TINY`` run: one FSDP rank, one
rollout replica) and ``=2`` (two FSDP ranks on gloo, two rollout replicas), compared at step 1. What
makes the two agree: the CPU rollout engine seeds a request from the engine seed, the policy version
and the prompt, not the replica (``verl_adapter/cpu_rollout.py``); the batch-centred advantage is
computed in the driver over the whole batch, its mean over the rewards in sorted order
(``loss/flashreinforce.masked_sequence_advantages``: verl balances the batch over the ranks in another
row order); the sample-mean loss is normalised by the global batch size on every rank (verl's
``global_batch_info``).

The batch (response lengths, score extremes, advantages, verl's recompute against the rollout) and the
FlashREINFORCE statistics are bitwise equal (measured: docs/results.md); the loss and the gradient norm
agree within a relative 1e-6: DP 2 adds the two ranks' losses and all-reduces their gradients, DP 1
accumulates other micro-batches -- another summation order, not bitwise (equal on an AMD AVX-512 CPU, one
fp32 ulp apart on an AMD AVX2 one; verl's ``critic/score/mean`` is a mean over the rows in batch order).
"""

import pytest

from true_on_policy.verl_adapter.trainer_hooks import LOGPROB_DIFF_METRIC, MISMATCHED_TOKENS_METRIC
from verl_run import CPU_TINY, Run, same_bits, train_steps

pytestmark = pytest.mark.e2e

DP_2 = Run("cpu_tiny", train_steps(1) + ("trainer.n_gpus_per_node=2",))
# The same two ranks as one Ulysses SP group of 2 (DP 1): verl slices every packed batch over them; the
# project's model code all-to-alls around the attention (tests/unit/test_ulysses.py: SP 2 == SP 1 bitwise,
# its twin without the all-to-all differs). Two steps: the second recompute runs on weights the SP backward
# updated.
ULYSSES_STEPS = 2
ULYSSES_2 = Run("cpu_tiny", train_steps(ULYSSES_STEPS) + (
    "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2"))

BATCH_METRICS = (
    "critic/score/max", "critic/score/min", "critic/advantages/max", "critic/advantages/min", "response_length/mean",
    "response_length/max", "response_length/min", "training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
    "actor/flashreinforce/acceptance_rate", "actor/flashreinforce/sequence_kl_mean",
)
BOUND_METRICS = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "critic/advantages/mean")
RELATIVE_BOUND = 1e-6


@pytest.fixture
def runs(verl_runs):
    return {1: verl_runs(CPU_TINY).metrics[1], 2: verl_runs(DP_2).metrics[1]}


def test_the_batch_and_its_statistics_are_bitwise_equal(runs):
    one, two = runs[1], runs[2]
    assert two["global_seqlen/mean"] * 2 == one["global_seqlen/mean"]  # two ranks, each half the tokens
    for name in BATCH_METRICS:
        assert same_bits(one[name], two[name]), (name, one[name], two[name])


def test_loss_and_the_batch_means_agree_within_the_summation_bound(runs):
    one, two = runs[1], runs[2]
    for name in BOUND_METRICS:
        diff = abs(one[name] - two[name]) / max(abs(one[name]), 1e-12)
        print(f"{name}: DP1 {one[name]!r} DP2 {two[name]!r} relative difference {diff:.2e}")
        assert diff <= RELATIVE_BOUND, (name, one[name], two[name])


def test_ulysses_sequence_parallel_2_is_bitwise_on_policy_at_every_step(verl_runs):
    """verl's recompute on the SP-split batch equals the rollout's recorded log-probs, token for token, and
    step 1's batch is SP 1's (one rank, no split): the same responses, scores and log-probs."""
    steps = verl_runs(ULYSSES_2).metrics
    assert sorted(steps) == list(range(1, ULYSSES_STEPS + 1))
    for step, metrics in steps.items():
        assert metrics["training/rollout_probs_diff_max"] == 0.0, (step, metrics)
        assert metrics[MISMATCHED_TOKENS_METRIC] == 0.0 and metrics[LOGPROB_DIFF_METRIC] == 0.0, (step, metrics)
    one = verl_runs(CPU_TINY).metrics[1]
    for name in ("response_length/mean", "critic/score/max", "critic/score/min", "training/rollout_probs_diff_mean"):
        assert same_bits(one[name], steps[1][name]), (name, one[name], steps[1][name])
