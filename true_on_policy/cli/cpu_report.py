"""``python -m true_on_policy cpu-report [--json]``: what this CPU's kernel bits rest on.

The CPU (model, the flags the kernels read), torch's CPU capability, MKL's version, the variables that make MKL
or torch pick other kernels, the BLAS fingerprint and goldens key (:mod:`true_on_policy.kernels.premises`),
whether the checkout's goldens index holds the key, the native library's load-time checks, and per op its
routes (which this CPU's checks allow) and the vendor kernels each route's bits rest on. ``make test`` prints
it first, so a CI log names the CPU its bits were checked on. ``--json``: the report as JSON alone on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# the checkout's goldens index (absent from an installed package: the report says so)
GOLDENS_INDEX = Path(__file__).resolve().parents[2] / "tests" / "support" / "data" / "kernel_goldens.json"


def _goldens(key: str) -> dict:
    """Whether the checkout's goldens index holds ``key``, and its entry."""
    if not GOLDENS_INDEX.exists():
        return {"index": None, "held": None}
    entry = json.loads(GOLDENS_INDEX.read_text()).get(key)
    return {"index": str(GOLDENS_INDEX), "held": entry is not None, **(entry or {})}


def _routes() -> dict[str, dict]:
    """Per op: each route with whether this CPU's checks allow it (its arguments aside) and what its bits rest
    on, the torch code last; ``route``: the first allowed (what a call whose arguments fit takes)."""
    from true_on_policy.kernels import ops

    checks = {name: probe() for name, probe in ops.PROBES.items()}
    table = {}
    for op, spec in ops.SPEC_RESTS_ON.items():
        paths = [{"path": route.path, "allowed": all(checks[name] for name in route.probes),
                  "bits_rest_on": list(route.rests_on)} for route in ops.ROUTES.get(op, ())]
        paths.append({"path": "torch", "allowed": True, "bits_rest_on": list(spec)})
        first = next(path for path in paths if path["allowed"])
        table[op] = {"route": first["path"], "bits_rest_on": first["bits_rest_on"], "paths": paths}
    return table


def report() -> dict:
    """The report as a dict (what ``--json`` prints)."""
    import torch

    from true_on_policy.kernels import ops, premises

    info = premises.cpu_info()
    key = premises.key()
    return {
        "cpu": info["model"], "cores": info["cores"], "flags": info["flags"],
        "torch": str(torch.__version__), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(), "mkl": premises.mkl_version(),
        "environment": {name: os.environ[name] for name in premises.KERNEL_ENVIRONMENT if name in os.environ},
        "torch_sqrt_is_ieee": premises.sqrt_is_ieee(),
        "probes": premises.probes(), "blas_fingerprint": premises.blas_fingerprint(), "goldens_key": key,
        "goldens": _goldens(key),
        "native_checks": {name: probe() for name, probe in ops.PROBES.items()},
        "ops": _routes(),
    }


def _bits(names: list[str]) -> str:
    return ", ".join(names) or "own order"


def _print(r: dict) -> None:
    flags = " ".join(f"{flag}{'+' if present else '-'}" for flag, present in r["flags"].items())
    print(f"cpu          {r['cpu']} ({r['cores']} cores): {flags}")
    print(f"torch        {r['torch']}, CPU capability {r['cpu_capability']}, {r['threads']} threads"
          + (f"; {r['environment']}" if r["environment"] else ""))
    print(f"blas         {r['mkl']}; torch's fp32 sqrt {'is' if r['torch_sqrt_is_ieee'] else 'is not'} IEEE")
    print(f"fingerprint  {r['blas_fingerprint']}  ({' '.join(f'{k} {v}' for k, v in r['probes'].items())})")
    goldens = r["goldens"]
    held = ("no checkout index" if goldens["held"] is None else f"held: {goldens['file']}" if goldens["held"] else
            "NOT held: the goldens tests skip by name (python tests/support/kernel_goldens.py --adopt | --write)")
    print(f"goldens key  {r['goldens_key']}  {held}")
    if goldens["held"]:
        print(f"             {goldens['measured_on']}")
    print("native       " + " ".join(f"{name}{'+' if ok else '-'}" for name, ok in r["native_checks"].items()))
    print("op                     route   bits rest on                  other paths (+ allowed here, - not)")
    for op, entry in r["ops"].items():
        others = "; ".join(f"{p['path']}{'+' if p['allowed'] else '-'} {_bits(p['bits_rest_on'])}"
                           for p in entry["paths"] if p["path"] != entry["route"])
        print(f"  {op:21} {entry['route']:7} {_bits(entry['bits_rest_on']):29} {others}".rstrip())


def main(argv: list[str] | None = None) -> int:
    from true_on_policy.cli.json_output import stdout_to_stderr

    parser = argparse.ArgumentParser(prog="python -m true_on_policy cpu-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="the report as JSON alone on stdout")
    args = parser.parse_args(argv)
    with stdout_to_stderr(args.json):
        r = report()
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        _print(r)
    return 0
