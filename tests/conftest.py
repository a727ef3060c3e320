"""Test isolation for the whole suite, the shared verl runs, the pytest-xdist grouping, and the layout.

The layout: a test's directory is the tier its markers (pyproject.toml) put it in, checked at collection.
- ``tests/unit/``: in-process tests, none of the markers below (``make test-fast`` runs these).
- ``tests/engine/``: tests that start an engine or a fresh process, not verl's trainer (``vllm``,
  ``subprocess``).
- ``tests/e2e/``: tests that run verl's real trainer (``e2e``; some also ``vllm``).
A file whose tests span tiers is split by this rule: the part outside its first tier carries the tier as a
suffix (``test_patches.py``, ``test_patches_engine.py``, ``test_patches_e2e.py``), test names unchanged.
Every helper that is not a test file (modules, agent loops and their yaml, data files) lives in
``tests/support/``, which this file puts on ``sys.path``: a helper is imported by its bare name.
"""

import os
import sys
from collections import Counter
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "support"))

from verl_run import SharedRuns  # noqa: E402  (tests/support, on the path above)

# The tier each marker puts a test in, heaviest first: a test's directory is its heaviest marker's tier.
TIER_OF_MARKER = {"e2e": "e2e", "vllm": "engine", "subprocess": "engine"}

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # N workers share the cores: each (and what it starts) gets cores / N intra-op threads. Two full
    # OpenMP teams on the same cores spin-wait on each other and turn short kernels into long waits.
    _THREADS = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ["OMP_NUM_THREADS"] = _THREADS
    import torch

    torch.set_num_threads(int(_THREADS))


def pytest_report_header(config):
    """The key the kernel goldens are read by (this CPU's vendor kernels: kernels/premises.py) and the CPU."""
    from true_on_policy.kernels import premises

    return f"cpu: {premises.cpu_info()['model']}; goldens key {premises.key()}; {premises.mkl_version()}"


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
    """``verl_runs(run) -> RunResult``: each distinct verl run launched once per session (tests/support/verl_run.py).

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
    _check_layout(items)
    vllm, e2e, first_seen = Counter(), Counter(), {}
    for index, item in enumerate(items):
        name = item.nodeid.split("::")[0]
        first_seen.setdefault(name, index)
        vllm[name] += item.get_closest_marker("vllm") is not None
        e2e[name] += item.get_closest_marker("e2e") is not None
    items.sort(key=lambda item: (-vllm[(f := item.nodeid.split("::")[0])], -e2e[f], first_seen[f]))


def _tier(item) -> str:
    """The directory a test belongs in, by its markers (the rule of this file's docstring)."""
    return next((TIER_OF_MARKER[name] for name in TIER_OF_MARKER if item.get_closest_marker(name)), "unit")


def _check_layout(items) -> None:
    """Every test under tests/ sits in its tier's directory: a misplaced one stops the run, named."""
    misplaced = sorted({
        f"{item.nodeid.split('::')[0]}: belongs in tests/{_tier(item)}/"
        for item in items
        if item.path.is_relative_to(TESTS) and item.path.relative_to(TESTS).parts[0] != _tier(item)
    })
    if misplaced:
        raise pytest.UsageError("tests in the wrong directory (tests/conftest.py):\n" + "\n".join(misplaced))
