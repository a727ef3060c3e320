"""Every consistent kernel, a model's training forward/backward and its rollout keep their bits.

``tests/support/data/kernel_goldens_<CPU capability>.pt`` was written by ``python tests/support/kernel_goldens.py --write``
from the kernels' torch code; any speed-up must reproduce every entry with ``torch.equal``. Its twins show
the check has teeth: the kernels' own siblings (a different K chunk, the linear's previous order)
change bits. The Gated DeltaNet's CPU-independent pieces have their own file, one for every CPU
(``tests/support/gdn_goldens.py``).
"""

from __future__ import annotations

import pytest
import torch

import gdn_goldens
import kernel_goldens
from kernel_helpers import threads


@pytest.fixture(scope="module")
def goldens():
    return kernel_goldens.load()


def _mismatches(expected: dict, actual: dict) -> list[str]:
    bad = sorted(set(expected) ^ set(actual))
    for name in sorted(set(expected) & set(actual)):
        a, e = actual[name], expected[name]
        if a.dtype != e.dtype or a.shape != e.shape or not torch.equal(a, e):
            bad.append(name)
    return bad


@pytest.mark.parametrize("group", kernel_goldens.GROUPS)
def test_kernels_reproduce_the_goldens_bitwise(goldens, group):
    with threads(2):
        actual = kernel_goldens.compute((group,))
    expected = {k: v for k, v in goldens.items() if k.startswith(group + "/") or (group == "ops" and not k.startswith("model/"))}
    assert expected, f"no golden entries for {group}"
    bad = _mismatches(expected, actual)
    assert not bad, f"{len(bad)} of {len(expected)} entries changed bits: {bad[:20]}"


def test_ops_goldens_hold_with_one_thread(goldens):
    with threads(1):
        actual = kernel_goldens.compute(("ops",))
    expected = {k: v for k, v in goldens.items() if not k.startswith("model/")}
    assert not _mismatches(expected, actual)


def test_twin_a_different_k_chunk_breaks_the_goldens(goldens, monkeypatch):
    """The problem the check guards against: another reduction order changes bits it would catch."""
    from true_on_policy.kernels.ops import tiling

    monkeypatch.setattr(tiling, "K_CHUNK", 64)  # the ops modules read it there, at call time
    with threads(2):
        actual = kernel_goldens.compute(("ops",))
    expected = {k: v for k, v in goldens.items() if not k.startswith("model/")}
    bad = _mismatches(expected, actual)
    assert "matmul_tiles/k300" in bad and "linear/tree/k1048" in bad, bad


def test_twin_the_previous_linear_order_breaks_the_goldens(goldens, monkeypatch):
    """The goldens were rewritten for the reduction tree (issue 21): the previous order -- K chunks
    added left to right, no leaves -- gives other linear bits, which the goldens catch; the ops
    without a linear keep theirs."""
    from true_on_policy.kernels.ops import linear_tree

    monkeypatch.setattr(linear_tree, "k_leaves", lambda k: 1)
    monkeypatch.setattr(linear_tree, "local_leaves", lambda k, parts: 1)
    with threads(2):
        actual = kernel_goldens.compute(("ops",))
    expected = {k: v for k, v in goldens.items() if not k.startswith("model/")}
    bad = _mismatches(expected, actual)
    assert any(name.startswith("linear/fp32/m") and "k64" in name for name in bad), bad
    assert all(name.startswith("linear/") for name in bad), bad


def test_gated_delta_goldens_hold_bitwise_on_any_cpu():
    """The Gated DeltaNet's core (``tests/support/gdn_goldens.py``: correctly rounded arithmetic in the project's
    fixed order, no BLAS, no ``exp``, no ``sqrt``: one file for every CPU), on the current routes and with 1 thread."""
    expected = gdn_goldens.load()
    for n in (2, 1):
        with threads(n):
            assert not _mismatches(expected, gdn_goldens.compute()), n


def test_twin_torch_sum_in_place_of_the_fixed_tree_breaks_the_gated_delta_goldens(monkeypatch):
    """The check has teeth: the same core with torch's own reduction (its order, not the fixed tree) changes bits."""
    from true_on_policy.kernels import ops

    monkeypatch.setattr(ops, "fixed_sum", lambda x: x.sum(-1, keepdim=True))
    with threads(2), ops.switched(native=False):
        bad = _mismatches(gdn_goldens.load(), gdn_goldens.compute())
    assert "gdn/delta_rule/prefill/out" in bad, bad
