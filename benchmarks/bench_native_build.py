"""What building the native kernels costs: the sources as one translation unit (the build's) against one unit each.

Every source includes torch's extension header, whose parsing is most of a source's compile time; ``make install``
builds the library once per environment, CI's install among them. Each repeat builds both variants from scratch,
alternating, each in a fresh directory with the build's own flags (``native.CFLAGS``); CPU time is the machine's
(``/proc/stat``): run it on an idle machine and note the load. ninja runs as many compilers as torch lets it
(``MAX_JOBS``, default: the CPUs).

    python benchmarks/bench_native_build.py [--repeats 2] [--json]

Records: ``variant``, ``cpu_s`` and ``wall_s`` (medians over the repeats), ``ratio_cpu`` and ``ratio_wall``
(against ``per_source``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_launch_cost import machine_cpu_s  # noqa: E402

from true_on_policy.kernels import native  # noqa: E402


def build(variant: str, directory: Path) -> tuple[float, float]:
    """(CPU s, wall s) of building the library in ``directory``: ``one_unit`` compiles the build's one unit,
    ``per_source`` each staged source on its own."""
    from torch.utils.cpp_extension import load

    one_unit = native.staged_sources(directory)
    sources = one_unit if variant == "one_unit" else [directory / "src" / path.name for path in native.SOURCES]
    cpu, start = machine_cpu_s(), time.perf_counter()
    load(name=f"bench_{variant}_{directory.name}", sources=[str(path) for path in sources],
         extra_cflags=list(native.CFLAGS), extra_ldflags=list(native.LDFLAGS), build_directory=str(directory),
         verbose=False)
    return machine_cpu_s() - cpu, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the JSON list of records alone on stdout")
    args = parser.parse_args()
    variants = ("per_source", "one_unit")
    times: dict[str, list[tuple[float, float]]] = {variant: [] for variant in variants}
    for repeat in range(args.repeats):
        for variant in variants if repeat % 2 == 0 else variants[::-1]:
            with tempfile.TemporaryDirectory(prefix=f"native_{variant}_") as directory:
                times[variant].append(build(variant, Path(directory)))
    records = []
    for variant in variants:
        cpu = statistics.median(t[0] for t in times[variant])
        wall = statistics.median(t[1] for t in times[variant])
        records.append({"variant": variant, "cpu_s": round(cpu, 1), "wall_s": round(wall, 1)})
    for record in records:
        record["ratio_cpu"] = round(record["cpu_s"] / records[0]["cpu_s"], 3)
        record["ratio_wall"] = round(record["wall_s"] / records[0]["wall_s"], 3)
    if args.json:
        print(json.dumps(records))
        return
    for r in records:
        print(f"{r['variant']:10s} cpu {r['cpu_s']:7.1f} s  wall {r['wall_s']:7.1f} s  "
              f"ratio cpu {r['ratio_cpu']:.3f} wall {r['ratio_wall']:.3f}")


if __name__ == "__main__":
    main()
