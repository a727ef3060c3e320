"""Every consistent kernel, a model's training forward/backward and its rollout keep their bits.

A goldens file (``tests/support/data/kernel_goldens_*.pt``, written by ``python tests/support/kernel_goldens.py
--write`` from the kernels' torch code) is read for this CPU's key (``kernel_goldens.json``: the vendor kernels
most entries rest on); any speed-up must reproduce every entry with ``torch.equal``. A CPU whose key the index
lacks skips those tests by name (premise ``held_key``); the own-order entries (the project's order alone) are
checked on any CPU, on the ops' routes and on the own-order reference. Twins show the checks have teeth: the
kernels' own siblings (a different K chunk, the linear's previous order) change bits. The Gated DeltaNet's
CPU-independent pieces have their own file, one for every CPU (``tests/support/gdn_goldens.py``).
"""

from __future__ import annotations

import re

import pytest
import torch

import gdn_goldens
import kernel_goldens
from kernel_helpers import own_order, premise_skip, threads
from true_on_policy.kernels import native


@pytest.fixture(scope="module")
def goldens():
    return kernel_goldens.load_or_skip()


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


def test_the_index_maps_keys_to_held_files_and_says_how_each_was_found():
    """Every key of ``kernel_goldens.json`` is a :func:`premises.key` naming a file that is there, with its source."""
    for key, entry in kernel_goldens.index().items():
        assert set(entry) == {"file", "measured_on"} and (kernel_goldens.DATA / entry["file"]).exists(), key
        assert re.fullmatch(r"[A-Z0-9]+_g[0-9a-f]{6}v[0-9a-f]{6}", key), key  # premises.key(): capability_fingerprint


def test_a_key_without_goldens_is_a_named_skip_and_load_an_error(monkeypatch):
    """Never a failure, never a silent pass: the skip names the key and the premise (the twin: load() raises)."""
    from true_on_policy.kernels import premises

    monkeypatch.setattr(premises, "key", lambda: "AVX512_g000000v000000")
    with pytest.raises(pytest.skip.Exception, match=r"no kernel goldens for the key AVX512_g000000v000000 .*held_key"):
        kernel_goldens.load_or_skip()
    with pytest.raises(kernel_goldens.NoGoldens, match="AVX512_g000000v000000"):
        kernel_goldens.load()


def _own_order_bits(n_threads: int = 2) -> dict:
    """The ``ops`` group's own-order entries computed on the own-order reference."""
    with threads(n_threads), own_order():
        return kernel_goldens.own_order_entries(kernel_goldens.compute(("ops",)))


@pytest.mark.parametrize("n_threads", [2, 1])
def test_own_order_entries_hold_on_any_cpu(n_threads):
    """The entries whose bits are the project's order (the fixed tree, correctly rounded elementwise arithmetic,
    the linear's tiles as the library's fma chains) are every file's bits, computed without MKL's sgemm."""
    expected = kernel_goldens.load_own_order()
    assert {name.split("/")[0] + "/" for name in expected} == set(kernel_goldens.OWN_ORDER)
    assert not _mismatches(expected, _own_order_bits(n_threads))


def test_own_order_entries_hold_on_the_routes():
    """The ops' routes compute the own-order entries' bits where the route rule takes the project's order: the
    native fixed_sum, the torch code's elementwise ops, and the linear wherever its route is the fma chain."""
    expected = kernel_goldens.load_own_order()
    with threads(2):
        actual = kernel_goldens.own_order_entries(kernel_goldens.compute(("ops",)))
    bad = _mismatches(expected, actual)
    assert all(name.startswith("linear/") for name in bad), bad
    if bad and native.fma_chain_lib(native.FMA_CHAIN_MIN_N) is None:  # the linear's route: the torch code's tiles
        premise_skip("mkl_sgemm_chain", f"the load-time check failed and {len(bad)} linear entries are MKL's bits")
    assert not bad, bad


def test_twin_the_previous_linear_order_breaks_the_own_order_entries(monkeypatch):
    """The own-order entries have teeth without any key: the previous order (no leaves) changes linear
    entries, and only those."""
    from true_on_policy.kernels.ops import linear_tree

    monkeypatch.setattr(linear_tree, "k_leaves", lambda k: 1)
    monkeypatch.setattr(linear_tree, "local_leaves", lambda k, parts: 1)
    bad = _mismatches(kernel_goldens.load_own_order(), _own_order_bits())
    assert any(name.startswith("linear/fp32/m") and "k64" in name for name in bad), bad
    assert all(name.startswith("linear/") for name in bad), bad


def test_twin_a_different_k_chunk_breaks_the_own_order_entries(monkeypatch):
    """Another K chunk is another order of the linear's chains: a leaf of 131 (K = 1048) changes bits."""
    from true_on_policy.kernels.ops import tiling

    monkeypatch.setattr(tiling, "K_CHUNK", 64)
    bad = _mismatches(kernel_goldens.load_own_order(), _own_order_bits())
    assert "linear/tree/k1048" in bad and all(name.startswith("linear/") for name in bad), bad


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
