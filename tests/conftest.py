"""Test isolation for the whole suite, the shared verl runs, and the pytest-xdist grouping."""

import os
from collections import Counter

import pytest

from verl_run import SharedRuns

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # N workers share the cores: each (and what it starts) gets cores / N intra-op threads. Two full
    # OpenMP teams on the same cores spin-wait on each other and turn short kernels into long waits.
    _THREADS = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ["OMP_NUM_THREADS"] = _THREADS
    import torch

    torch.set_num_threads(int(_THREADS))


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test gets back the environment it started with, new keys removed too: the launch exports
    the determinism plan into ``os.environ`` (e.g. ``VLLM_BATCH_INVARIANT=1`` for a CUDA/Ascend plan),
    and a leaked key would reach every later subprocess (vLLM engines, verl runs) of the suite."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def verl_runs(tmp_path_factory) -> SharedRuns:
    """``verl_runs(run) -> RunResult``: each distinct verl run launched once per session (tests/verl_run.py).

    Under pytest-xdist the folder is the session's, above each worker's own, so workers share the runs.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return SharedRuns(root / "verl_runs")


def pytest_collection_modifyitems(config, items):
    """For ``-n N --dist loadfile --no-loadscope-reorder`` (make test): each file runs on one worker
    (so a module-scoped fixture -- a vLLM engine, a spawn of ranks -- starts once), and the files are
    queued heaviest first -- most vLLM tests, then most verl-launching ones -- so that the longest
    work does not start last. Without xdist the order changes only by whole files, which do not
    depend on each other. (pytest-xdist's ``loadgroup`` is not used: on this pytest it drops the
    groups silently, pytest-dev/pytest-xdist#1386.)"""
    vllm, e2e, first_seen = Counter(), Counter(), {}
    for index, item in enumerate(items):
        name = item.nodeid.split("::")[0]
        first_seen.setdefault(name, index)
        vllm[name] += item.get_closest_marker("vllm") is not None
        e2e[name] += item.get_closest_marker("e2e") is not None
    items.sort(key=lambda item: (-vllm[(f := item.nodeid.split("::")[0])], -e2e[f], first_seen[f]))
