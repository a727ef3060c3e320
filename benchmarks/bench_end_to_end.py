"""End-to-end cost of the consistent kernels in verl's real trainer: flag on vs off, alternating.

For each config (``cpu_tiny``, ``cpu_tiny_moe``) and repeat, runs
``python -m verl.trainer.main_ppo --config-path=configs --config-name=<config>`` twice -- with
``true_on_policy.deterministic=true`` and ``=false``, the order alternating between repeats -- and
reads verl's per-step ``timing_s/step`` from verl's file logger (``trainer.logger=[console,file]``,
the JSONL path set through ``VERL_FILE_LOGGER_PATH``, see ``verl/utils/tracking.py``). Step 1 (Ray,
worker and model start-up) is left out; a run's time is the median of its other steps; a config's
``on_s``/``off_s`` are the medians over repeats and ``ratio`` = on_s / off_s. ``--override`` adds a
Hydra override to every launch (e.g. ``+precision=bf16``: bf16 on both sides) and to the case name.
Usage: python benchmarks/bench_end_to_end.py [--json] [--steps N] [--repeats N] [--configs NAME ...]
       [--override KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METRIC = "timing_s/step"


def run(config: str, flag: bool, steps: int, timeout: int, overrides: list[str]) -> list[float]:
    """``timing_s/step`` of every step after the first, read from verl's file logger."""
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "metrics.jsonl"
        env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(log_path), "HYDRA_FULL_ERROR": "1"}
        command = [
            sys.executable,
            "-m",
            "verl.trainer.main_ppo",
            f"--config-path={REPO / 'configs'}",
            f"--config-name={config}",
            f"trainer.total_training_steps={steps}",
            "trainer.logger=[console,file]",
            f"true_on_policy.deterministic={str(flag).lower()}",
            f"hydra.run.dir={tmp}/hydra",
            *overrides,
        ]
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            tail = (result.stdout + result.stderr)[-4000:]
            raise RuntimeError(f"trainer exited {result.returncode}: {' '.join(command)}\n{tail}")
        records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    times = {r["step"]: r["data"][METRIC] for r in records if METRIC in r["data"]}
    if sorted(times) != list(range(1, steps + 1)):
        raise RuntimeError(f"{config} flag={flag}: file logger has {METRIC} for steps {sorted(times)}, expected 1..{steps}")
    return [times[s] for s in range(2, steps + 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true", help="one JSON record per config")
    parser.add_argument("--configs", nargs="*", default=["cpu_tiny", "cpu_tiny_moe"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--override", action="append", default=[], help="a Hydra override for every launch")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (step 1 is start-up), got {args.steps}")
    for config in args.configs:
        per_run = {True: [], False: []}
        for repeat in range(args.repeats):
            for flag in (True, False) if repeat % 2 == 0 else (False, True):
                step_times = run(config, flag, args.steps, args.timeout, args.override)
                per_run[flag].append(statistics.median(step_times))
                progress = dict(config=config, deterministic=flag, repeat=repeat, step_s=step_times)
                print(json.dumps(progress), file=sys.stderr, flush=True)  # partial results survive a kill
        on, off = statistics.median(per_run[True]), statistics.median(per_run[False])
        record = dict(
            case=" ".join([f"e2e/{config}", *args.override]),
            on_s=round(on, 4),
            off_s=round(off, 4),
            ratio=round(on / off, 3),
            on_runs_s=[round(x, 4) for x in per_run[True]],
            off_runs_s=[round(x, 4) for x in per_run[False]],
            steps=args.steps,
            repeats=args.repeats,
        )
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(f"{record['case']:20s} on {on:.3f} s/step  off {off:.3f} s/step  ratio {record['ratio']:.3f}", flush=True)


if __name__ == "__main__":
    main()
