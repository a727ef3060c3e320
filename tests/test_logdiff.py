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
        if record["deterministic"]:
            # logdiff reports 0.0 only when torch.equal holds for every token
            assert record["max_abs_diff"] == 0.0 and record["frac_equal"] == 1.0, record
        else:
            # the same measurement without the consistent kernels: the check is not vacuous
            assert record["max_abs_diff"] > 0.0 and record["frac_equal"] < 1.0, record


def test_prompt_lengths_span_1_to_200():
    from true_on_policy.cli.logdiff import prompt_lengths

    lengths = prompt_lengths(8)
    assert lengths[0] == 1 and lengths[-1] == 200 and len(set(lengths)) == 8
