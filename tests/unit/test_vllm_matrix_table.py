"""scripts/vllm_matrix_table.py, the vLLM window's verdict: a table of release x case, exit 1 unless every flag-on
case is 0, every flag-off twin that runs differs and the verl run held 0 mismatched tokens."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

TABLE = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "vllm_matrix_table.py"))


def _record(model, dtype, flag, diff=None, tp=1, ep=1, skipped=None):
    record = {"model": model, "dtype": dtype, "deterministic": flag, "tp": tp, "ep": ep}
    return {**record, "skipped": skipped} if skipped else {**record, "max_abs_diff": diff}


def _write(out: Path, release: str, on: float, off: float, e2e_rc: str = "0") -> None:
    (out / f"dense-{release}.json").write_text(json.dumps([
        _record("dense", "float32", True, on), _record("dense", "float32", False, off)]))
    (out / f"moe-{release}.json").write_text(json.dumps([
        _record("moe", "bfloat16", True, 0.0, tp=2, ep=2),
        _record("moe", "bfloat16", False, tp=2, ep=2, skipped="stock crashes with EP")]))
    (out / f"e2e-{release}").mkdir()
    (out / f"e2e-{release}" / "rc").write_text(e2e_rc)


def test_a_window_held_bitwise_passes_with_one_row_per_case(tmp_path, capsys):
    _write(tmp_path, "0.29.0", on=0.0, off=4.77e-07)
    assert TABLE["main"]([str(tmp_path), "0.29.0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "| dense fp32 TP1 | 0 / 4.77e-07 |" in lines and "| moe bf16 TP2+EP2 | 0 / skip |" in lines
    assert "| verl e2e (cpu_tiny_vllm) | 0 mismatched tokens every step |" in lines


def test_twins_a_nonzero_flag_on_a_silent_twin_or_a_failed_run_fail_the_matrix(tmp_path):
    for release, on, off, rc in (("a", 1e-07, 4.77e-07, "0"), ("b", 0.0, 0.0, "0"), ("c", 0.0, 4.77e-07, "1")):
        out = tmp_path / release
        out.mkdir()
        _write(out, release, on, off, rc)
        assert TABLE["main"]([str(out), release]) == 1, release
