"""``python -m true_on_policy logdiff --json``: zero with the flag on, non-zero with it off."""

import json
import subprocess
import sys

import pytest
from verl_run import REPO


@pytest.mark.subprocess
def test_logdiff_cli_reports_zero_only_with_the_flag_on():
    result = subprocess.run(
        [sys.executable, "-m", "true_on_policy", "logdiff", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    records = json.loads(result.stdout)
    combos = {(r["model"], r["dtype"], r["deterministic"]) for r in records}
    kinds = ("dense", "moe", "qwen2", "llama", "qwen35", "qwen35_moe")
    assert combos == {(m, d, f) for m in kinds for d in ("float32", "bfloat16") for f in (True, False)}
    for record in records:
        # 8 prompts x 64 generated tokens, all scored
        assert record["tokens"] == 8 * 64
        # logdiff reports 0.0 only when torch.equal holds for every token
        assert (record["max_abs_diff"] == 0.0) == (record["frac_equal"] == 1.0), record
        if record["deterministic"]:
            assert record["max_abs_diff"] == 0.0, record
    # The same measurement without the consistent kernels: the check is not vacuous. Which stock
    # kernels happen to agree depends on the CPU's instruction set (AVX2 / AVX-512 / AMX), so the
    # twin asks for a difference somewhere per model, not in every (model, dtype) record.
    for model in ("dense", "moe", "qwen2", "llama"):
        off = [r for r in records if r["model"] == model and not r["deterministic"]]
        assert any(r["max_abs_diff"] > 0.0 for r in off), off
