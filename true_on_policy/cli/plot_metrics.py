"""Read verl's file-logger JSONL and plot a run: ``python -m true_on_policy plot-metrics``.

verl's ``FileLogger`` (``trainer.logger=[console,file]``; path from ``$VERL_FILE_LOGGER_PATH``)
writes one JSON object per logged step, ``{"step": N, "data": {metric: value}}``. This module reads
it (:func:`read_step_metrics`), summarises the reward (:func:`reward_summary`: mean of the first and
the last ``window`` steps) and draws one panel per metric in :data:`PANELS` (:func:`plot`).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from pathlib import Path

REWARD = "critic/score/mean"
STEP_TIME = "timing_s/step"
MISMATCHED_TOKENS = "logdiff/mismatched_tokens"  # the recipe's per-token count (verl_adapter.trainer_hooks)
PANELS = (
    (REWARD, "reward (batch mean)"),
    ("actor/flashreinforce/acceptance_rate", "trust-region acceptance rate"),
    ("actor/flashreinforce/sequence_kl_mean", "sequence KL (mean)"),
    ("training/rollout_probs_diff_max", "rollout_probs_diff_max (training vs rollout)"),
    (MISMATCHED_TOKENS, "tokens whose log-prob bits differ (training vs rollout)"),
    (STEP_TIME, "step time (s)"),
)

StepMetrics = dict[int, dict[str, float]]


def read_step_metrics(path: str | Path) -> StepMetrics:
    """``{step: {metric: value}}``; non-numeric values are left out, JSON null (a NaN) reads as NaN."""
    steps: StepMetrics = {}
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step, data = int(record["step"]), record["data"]
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number} is not a verl file-logger record ({error}): {line[:120]!r}") from None
            metrics = steps.setdefault(step, {})
            for key, value in data.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    metrics[key] = float(value)
                elif value is None:
                    metrics[key] = math.nan
    return steps


def series(steps: StepMetrics, key: str) -> tuple[list[int], list[float]]:
    """The steps that logged ``key`` and its values, in step order."""
    xs = [step for step in sorted(steps) if key in steps[step]]
    return xs, [steps[step][key] for step in xs]


def reward_summary(steps: StepMetrics, window: int = 5, key: str = REWARD) -> dict[str, float]:
    """Mean of ``key`` over the first and the last ``window`` logged steps, and the gain."""
    _, values = series(steps, key)
    if len(values) < 2 * window:
        raise ValueError(f"{key}: {len(values)} steps logged, need at least {2 * window} for first/last {window}")
    first = sum(values[:window]) / window
    last = sum(values[-window:]) / window
    return {"first": first, "last": last, "gain": last - first, "steps": len(values)}


def plot(steps: StepMetrics, out: str | Path, title: str | None = None, panels=PANELS) -> Path:
    """One panel per metric against the step; a metric no step logged is an error naming it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    missing = [key for key, _ in panels if not series(steps, key)[0]]
    if missing:
        raise KeyError(f"no step logged {missing}; logged keys include {sorted(next(iter(steps.values()), {}))[:8]}")
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.0 * len(panels)), sharex=True, dpi=90)
    for ax, (key, label) in zip(axes, panels):
        xs, ys = series(steps, key)
        ax.plot(xs, ys, marker="o", markersize=3)
        ax.set_ylabel(label, fontsize=8)
        ax.set_title(key, fontsize=8, loc="left")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def format_summary(summary: Mapping[str, float], window: int) -> str:
    return (
        f"{REWARD}: first {window} steps {summary['first']:.3f}, last {window} steps {summary['last']:.3f} "
        f"(gain {summary['gain']:+.3f}, {int(summary['steps'])} steps)"
    )


def steps_with_mismatches(steps: StepMetrics) -> list[int]:
    """The steps whose :data:`MISMATCHED_TOKENS` is not 0 or was not logged (a run without it proves nothing)."""
    return [step for step, values in sorted(steps.items()) if values.get(MISMATCHED_TOKENS) != 0.0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m true_on_policy plot-metrics", description=__doc__.split("\n")[0])
    parser.add_argument("metrics", help="verl file-logger JSONL ($VERL_FILE_LOGGER_PATH of the run)")
    parser.add_argument("--out", default=None, help="PNG path (default: next to the JSONL, .png)")
    parser.add_argument("--title", default=None)
    parser.add_argument("--window", type=int, default=5, help="steps averaged at each end for the reward summary")
    parser.add_argument("--require-zero-logdiff", action="store_true",
                        help=f"exit 1 unless {MISMATCHED_TOKENS} is 0 at every logged step")
    args = parser.parse_args(argv)
    steps = read_step_metrics(args.metrics)
    if not steps:
        parser.error(f"{args.metrics} holds no step")
    out = plot(steps, args.out or Path(args.metrics).with_suffix(".png"), args.title)
    print(f"metrics: {Path(args.metrics).resolve()}")
    print(f"plot:    {out.resolve()}")
    if len(series(steps, REWARD)[1]) >= 2 * args.window:
        print(format_summary(reward_summary(steps, args.window), args.window))
    if args.require_zero_logdiff:
        if bad := steps_with_mismatches(steps):
            print(f"{MISMATCHED_TOKENS}: not 0 (or not logged) at steps {bad}")
            return 1
        print(f"{MISMATCHED_TOKENS}: 0 at all {len(steps)} steps")
    return 0


__all__ = ["PANELS", "plot", "read_step_metrics", "reward_summary", "series", "steps_with_mismatches", "main"]
