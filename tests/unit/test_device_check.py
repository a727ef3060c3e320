"""The CUDA device check's python part, run on CPU (no GPU here): real kernels, real property (its script:
tests/engine/test_device_check_engine.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from true_on_policy import tiny_assets

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import device_check  # noqa: E402


def test_device_check_on_cpu_flag_on_is_bitwise_and_off_is_not(tmp_path):
    # Whether the stock kernels give both sides the same bits at a prompt length depends on the CPU's
    # instruction set (at 40 tokens AVX2's do): the twin searches a few lengths for a difference.
    tried = []
    for longest in (200, 120, 64):
        out = tmp_path / f"records-{longest}.json"
        assert device_check.main(
            ["--device", "cpu", "--prompts", "8", "--longest", str(longest), "--new-tokens", "8", "--repeats", "1",
             "--json", str(out)]
        ) == 0
        records = json.loads(out.read_text())
        logdiff = [r for r in records if r["case"].startswith("logdiff/")]
        assert {r["case"] for r in logdiff} == {f"logdiff/{kind}/bfloat16" for kind in tiny_assets.MODEL_KINDS}
        on = [r for r in logdiff if r["deterministic"]]
        off = [r for r in logdiff if not r["deterministic"]]
        assert all(r["max_abs_diff"] == 0.0 and r["frac_equal"] == 1.0 and r["tokens"] == 64 for r in on)
        overhead = [r for r in records if r["case"].startswith("overhead/")]
        assert len(overhead) == 2 * len(tiny_assets.MODEL_KINDS)  # two cases per tiny model
        assert all(r["on_ms"] > 0 and r["off_ms"] > 0 and r["ratio"] == r["on_ms"] / r["off_ms"] for r in overhead)
        if any(r["max_abs_diff"] > 0.0 for r in off):  # the twin: without the kernels the sides differ
            return
        tried.append(longest)
    pytest.fail(f"flag off, the stock kernels gave both sides the same bits at every prompt length tried {tried}")
