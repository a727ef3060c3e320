"""Reading, summarising and plotting verl's file-logger JSONL (true_on_policy.cli.plot_metrics).

The JSONL is written by verl's own ``FileLogger`` (verl/utils/tracking.py), the writer of every run.
"""

import json
import math

import numpy as np
import pytest

from true_on_policy.cli import plot_metrics


def write_run(path, monkeypatch, rewards, extra=None):
    from verl.utils.tracking import FileLogger

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    logger = FileLogger("project", "experiment")
    for step, reward in enumerate(rewards, 1):
        data = {
            "critic/score/mean": np.float32(reward),  # verl hands numpy scalars to its loggers
            "actor/flashreinforce/acceptance_rate": 1.0,
            "actor/flashreinforce/sequence_kl_mean": 0.0,
            "training/rollout_probs_diff_max": 0.0,
            "logdiff/mismatched_tokens": 0.0,
            "timing_s/step": 0.5 + step,
            "response_length/mean": np.int64(step),
        }
        data.update(extra or {})
        logger.log(data=data, step=step)
    logger.finish()
    return path


def test_reads_what_verls_file_logger_writes(tmp_path, monkeypatch):
    path = write_run(tmp_path / "m.jsonl", monkeypatch, [0.25, 0.5], extra={"note": "text", "nan": float("nan")})
    steps = plot_metrics.read_step_metrics(path)
    assert sorted(steps) == [1, 2]
    assert steps[2]["critic/score/mean"] == 0.5
    assert steps[2]["response_length/mean"] == 2.0
    assert steps[1]["timing_s/step"] == 1.5
    assert "note" not in steps[1]  # non-numeric values are left out
    assert math.isnan(steps[1]["nan"])  # verl writes NaN as JSON null


def test_reward_summary_first_and_last_window(tmp_path, monkeypatch):
    rewards = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    steps = plot_metrics.read_step_metrics(write_run(tmp_path / "m.jsonl", monkeypatch, rewards))
    summary = plot_metrics.reward_summary(steps, window=5)
    assert summary["first"] == pytest.approx(0.2, abs=1e-6)
    assert summary["last"] == pytest.approx(0.7, abs=1e-6)
    assert summary["gain"] == pytest.approx(0.5, abs=1e-6)
    with pytest.raises(ValueError, match="9 steps logged, need at least 10"):
        plot_metrics.reward_summary({k: v for k, v in steps.items() if k < 10}, window=5)


def test_cli_writes_a_png_and_prints_both_paths(tmp_path, monkeypatch, capsys):
    path = write_run(tmp_path / "m.jsonl", monkeypatch, [0.1 * i for i in range(10)])
    assert plot_metrics.main([str(path)]) == 0
    png = tmp_path / "m.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000  # five drawn panels, not an empty canvas
    out = capsys.readouterr().out
    assert str(path.resolve()) in out and str(png.resolve()) in out
    assert "first 5 steps 0.200, last 5 steps 0.700 (gain +0.500" in out


def test_a_panel_no_step_logged_is_an_error_naming_it(tmp_path, monkeypatch):
    steps = plot_metrics.read_step_metrics(write_run(tmp_path / "m.jsonl", monkeypatch, [0.1, 0.2]))
    for metrics in steps.values():
        del metrics["actor/flashreinforce/sequence_kl_mean"]
    with pytest.raises(KeyError, match="actor/flashreinforce/sequence_kl_mean"):
        plot_metrics.plot(steps, tmp_path / "x.png")


def test_a_line_that_is_not_a_record_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"step": 1, "data": {}}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2 is not a verl file-logger record"):
        plot_metrics.read_step_metrics(path)


def test_require_zero_logdiff_passes_a_clean_run_and_names_the_steps_of_another(tmp_path, monkeypatch, capsys):
    """``make demo``'s check: 0 mismatched tokens at every step passes; the twin, one flipped ulp counted at
    step 2 (and a run that never logged the metric), exits 1 naming the steps."""
    clean = write_run(tmp_path / "clean.jsonl", monkeypatch, [0.1, 0.2, 0.3])
    assert plot_metrics.main([str(clean), "--require-zero-logdiff"]) == 0
    assert "logdiff/mismatched_tokens: 0 at all 3 steps" in capsys.readouterr().out
    flipped = write_run(tmp_path / "flipped.jsonl", monkeypatch, [0.1, 0.2, 0.3])
    records = [json.loads(line) for line in flipped.read_text().splitlines()]
    records[1]["data"]["logdiff/mismatched_tokens"] = 1.0  # step 2
    flipped.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert plot_metrics.main([str(flipped), "--require-zero-logdiff"]) == 1
    assert "not 0 (or not logged) at steps [2]" in capsys.readouterr().out
    missing = write_run(tmp_path / "missing.jsonl", monkeypatch, [0.1], extra={"logdiff/mismatched_tokens": None})
    assert plot_metrics.main([str(missing), "--require-zero-logdiff"]) == 1
