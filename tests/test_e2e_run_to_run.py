"""Two runs of the cpu_tiny config with the same seed produce bitwise identical metrics."""

import pytest

from verl_run import CPU_TINY, CPU_TINY_AGAIN, STEPS, differing, learned

pytestmark = pytest.mark.e2e


def test_same_seed_same_metrics_bitwise(verl_runs):
    first, second = verl_runs(CPU_TINY).metrics, verl_runs(CPU_TINY_AGAIN).metrics
    assert sorted(first) == sorted(second) == list(range(1, STEPS + 1))
    # every reproducible metric, bit for bit; a NaN (verl's JSON null) only matches a NaN
    assert not differing(first, second, first)
    # The runs learned something comparable: the loss is a finite non-zero number at least once.
    assert learned(first, first)
