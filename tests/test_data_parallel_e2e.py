"""FlashREINFORCE across data-parallel ranks, in verl's real trainer: DP = 1 and DP = 2 train on the same batch alike.

``cpu_tiny`` runs twice, with ``trainer.n_gpus_per_node=1`` (one FSDP rank, one rollout replica) and
``=2`` (two FSDP ranks on gloo, two rollout replicas). What makes the two agree:

* the CPU rollout engine seeds a request from the engine seed, the policy version and the prompt --
  not the replica (``verl_adapter/cpu_rollout.py``) -- so both runs collect the same trajectories
  whichever replica serves them (before: the replica rank entered the seed, and the two runs' step-1
  scores differed by 21 %);
* the batch-centred advantage is computed in the driver over the whole batch, its mean over the
  rewards in sorted order (``loss/flashreinforce.sequence_advantages``): verl balances the batch
  over the DP ranks in another row order, and a plain mean changed its last bit;
* the sample-mean loss is normalised by the global batch size on every rank (verl's
  ``global_batch_info``, ``verl_adapter/flashreinforce_registration.py``).

At step 1, from verl's file logger: the batch (response lengths, score extremes, advantages, verl's
recompute against the rollout) and the FlashREINFORCE statistics are bitwise equal; the loss and the
gradient norm agree within a relative 1e-6 -- DP 2 adds the two ranks' micro-batch gradients in
FSDP's reduce-scatter and the norm over shards, DP 1 accumulates other micro-batches: another
summation order, not bitwise. (verl's own ``critic/score/mean`` is a mean over the rows in batch
order: within one ulp.)
"""

import pytest

from verl_run import run_trainer

pytestmark = pytest.mark.e2e

BATCH_METRICS = (
    "critic/score/max", "critic/score/min", "critic/advantages/max", "critic/advantages/min", "response_length/mean",
    "response_length/max", "response_length/min", "training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
    "actor/flashreinforce/acceptance_rate", "actor/flashreinforce/sequence_kl_mean",
)
BOUND_METRICS = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "critic/advantages/mean")
RELATIVE_BOUND = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for dp in (1, 2):
        path = tmp_path_factory.mktemp(f"dp{dp}") / "metrics.jsonl"
        _, steps = run_trainer(
            "cpu_tiny", "trainer.total_training_steps=1", f"trainer.n_gpus_per_node={dp}", timeout=1800, metrics_path=path
        )
        out[dp] = steps[1]
    return out


def test_the_batch_and_its_statistics_are_bitwise_equal(runs):
    one, two = runs[1], runs[2]
    assert two["global_seqlen/mean"] * 2 == one["global_seqlen/mean"]  # two ranks, each half the tokens
    for name in BATCH_METRICS:
        assert one[name] == two[name], (name, one[name], two[name])


def test_loss_and_gradient_norm_agree_within_the_summation_bound(runs):
    one, two = runs[1], runs[2]
    for name in BOUND_METRICS:
        diff = abs(one[name] - two[name]) / max(abs(one[name]), 1e-12)
        print(f"{name}: DP1 {one[name]!r} DP2 {two[name]!r} relative difference {diff:.2e}")
        assert diff <= RELATIVE_BOUND, (name, one[name], two[name])
