"""What one verl launch costs the machine: CPU seconds (all of its processes) and wall time, two installs.

A launch is a dozen processes (Ray's actors, the FSDP ranks, vLLM's server, engine core and workers), each
importing verl and this plugin; most of CI's time is such launches. Each variant is a Python interpreter (a
venv) whose ``true_on_policy`` is the one to measure -- e.g. a venv beside this one whose path puts another
commit's checkout first; the variants alternate within each repeat, on this checkout's configs and
``$TRUE_ON_POLICY_ASSETS``. CPU time is the machine's (``/proc/stat``, user + nice + system) over the launch:
run it on an idle machine and note the load.

    python benchmarks/bench_launch_cost.py --variant old=/tmp/old-venv/bin/python --variant new=.venv/bin/python
        [--config cpu_tiny_vllm] [--steps 2] [--repeats 2] [--json]

Records: ``variant``, ``cpu_s`` and ``wall_s`` (medians over the repeats), ``ratio_cpu`` and ``ratio_wall``
(against the first variant).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def machine_cpu_s() -> float:
    """User + nice + system time of all CPUs since boot, in seconds."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:4]
    return sum(int(f) for f in fields) / os.sysconf("SC_CLK_TCK")


def launch(python: str, config: str, steps: int) -> tuple[float, float]:
    """(CPU s, wall s) of one launch under ``python``; raises if it fails."""
    with tempfile.TemporaryDirectory() as run:
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
        command = [python, "-m", "verl.trainer.main_ppo", f"--config-path={REPO / 'configs'}",
                   f"--config-name={config}", f"trainer.total_training_steps={steps}",
                   "++ray_kwargs.ray_init.include_dashboard=false", f"trainer.default_local_dir={run}/checkpoints",
                   f"hydra.run.dir={run}/hydra"]
        cpu, start = machine_cpu_s(), time.perf_counter()
        result = subprocess.run(command, cwd=run, env=env, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - start, machine_cpu_s() - cpu
    if result.returncode != 0:
        raise SystemExit(f"launch under {python} failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", required=True, help="NAME=PYTHON (a venv's interpreter)")
    parser.add_argument("--config", default="cpu_tiny_vllm")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the JSON list of records alone on stdout")
    args = parser.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant)
    for name, python in variants.items():
        if not os.access(python, os.X_OK):
            raise SystemExit(f"--variant {name}={python}: not an executable interpreter")
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, python in variants.items():
            samples[name].append(launch(python, args.config, args.steps))
    records = [{"variant": name, "cpu_s": statistics.median(c for c, _ in s), "wall_s": statistics.median(w for _, w in s)}
               for name, s in samples.items()]
    for r in records:
        r["ratio_cpu"], r["ratio_wall"] = r["cpu_s"] / records[0]["cpu_s"], r["wall_s"] / records[0]["wall_s"]
    if args.json:
        print(json.dumps(records, indent=1))
        return
    for r in records:
        print(f"{r['variant']:<8} cpu {r['cpu_s']:7.1f} s  wall {r['wall_s']:6.1f} s  "
              f"ratio cpu {r['ratio_cpu']:.3f}  wall {r['ratio_wall']:.3f}  ({args.config}, {args.steps} steps)")


if __name__ == "__main__":
    main()
