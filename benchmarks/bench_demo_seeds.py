"""The demo, for several seeds, with the true-on-policy flag on and off: what it learns, what changes.

For each seed it runs ``python -m verl.trainer.main_ppo --config-name=cpu_tiny`` (the ``make demo``
launch) once with ``true_on_policy.deterministic=true`` and once with ``=false``, alternating the two
so machine load hits both alike, and reads each run's metrics from verl's file logger (JSONL). A seed
sets ``data.seed`` (prompt order) and ``actor_rollout_ref.rollout.seed`` (sampling).

Per run: ``critic/score/mean`` averaged over the first and the last ``--window`` steps and the gain;
``training/rollout_probs_diff_max`` over all steps (0.0 only if every step was bitwise consistent);
the lowest FlashREINFORCE acceptance rate; the median ``timing_s/step`` from step 2 on; wall time.
``--json`` writes one record per seed: ``case``, both variants' median step times, their ``ratio``
(on / off), and every per-run number above.

    python benchmarks/bench_demo_seeds.py --seeds 1 2 3 --steps 30 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from true_on_policy.cli.plot_metrics import REWARD, STEP_TIME, read_step_metrics, reward_summary, series

REPO = Path(__file__).resolve().parents[1]
VARIANTS = (("on", "true_on_policy.deterministic=true"), ("off", "true_on_policy.deterministic=false"))


def run_demo(seed: int, steps: int, flag_override: str, metrics_path: Path, timeout: int) -> float:
    command = [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        f"--config-path={REPO / 'configs'}",
        "--config-name=cpu_tiny",
        f"trainer.total_training_steps={steps}",
        "trainer.logger=[console,file]",
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        flag_override,
    ]
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics_path)}
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise SystemExit(f"run failed ({result.returncode}): {' '.join(command)}\n{(result.stdout + result.stderr)[-4000:]}")
    return time.monotonic() - started


def summarise(metrics_path: Path, window: int, wall_s: float) -> dict:
    steps = read_step_metrics(metrics_path)
    reward = reward_summary(steps, window)
    _, diffs = series(steps, "training/rollout_probs_diff_max")
    _, acceptance = series(steps, "actor/flashreinforce/acceptance_rate")
    step_numbers, step_times = series(steps, STEP_TIME)
    _, lengths = series(steps, "response_length/mean")
    return {
        "steps": len(steps),
        "reward_first": reward["first"],
        "reward_last": reward["last"],
        "reward_gain": reward["gain"],
        "rollout_probs_diff_max": max(diffs),
        "steps_with_nonzero_diff": sum(d != 0.0 for d in diffs),
        "acceptance_min": min(acceptance),
        "median_step_s": statistics.median(t for n, t in zip(step_numbers, step_times) if n >= 2),
        "response_length_first": lengths[0],
        "response_length_last": lengths[-1],
        "wall_s": wall_s,
        "rewards": series(steps, REWARD)[1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    parser.add_argument("--json", default=None, help="write the records to this file")
    args = parser.parse_args(argv)

    records = []
    with tempfile.TemporaryDirectory(prefix="bench_demo_") as scratch:
        for seed in args.seeds:
            record: dict = {"case": f"seed={seed}", "seed": seed}
            for name, override in VARIANTS:
                path = Path(scratch) / f"seed{seed}_{name}.jsonl"
                wall_s = run_demo(seed, args.steps, override, path, args.timeout)
                record[name] = summarise(path, args.window, wall_s)
            record["on_median_step_s"] = record["on"]["median_step_s"]
            record["off_median_step_s"] = record["off"]["median_step_s"]
            record["ratio"] = record["on_median_step_s"] / record["off_median_step_s"]
            records.append(record)
            print(format_record(record, args.window), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
        print(f"wrote {args.json}")
    return 0


def format_record(record: dict, window: int) -> str:
    lines = [f"{record['case']}  (step time on/off: {record['ratio']:.2f}x)"]
    for name in ("on", "off"):
        r = record[name]
        lines.append(
            f"  deterministic={name:3s} reward first {window} {r['reward_first']:.3f}  last {window} {r['reward_last']:.3f}"
            f"  gain {r['reward_gain']:+.3f} | rollout_probs_diff_max {r['rollout_probs_diff_max']:.1e}"
            f" ({r['steps_with_nonzero_diff']}/{r['steps']} steps != 0) | acceptance min {r['acceptance_min']:.3f}"
            f" | median step {r['median_step_s']:.2f} s | response length {r['response_length_first']:.1f}"
            f" -> {r['response_length_last']:.1f} | wall {r['wall_s']:.0f} s"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
