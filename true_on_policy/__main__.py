"""``python -m true_on_policy <command>``: the project's command line.

  build-assets   build the tiny offline models, tokenizer and task data (idempotent)
  build-native   build the C++ fast path of the consistent kernels on CPU (idempotent; the same bits)
  cpu-report     this CPU's flags, MKL, BLAS fingerprint and goldens key, and what each op's bits rest on
  fetch-keys     fetch the released upstream sources the determinism keys cite, and read every key again
  check          the training/rollout consistency contract of a Hydra config (exit 0 / 2)
  logdiff        measure training-vs-rollout log-prob differences (dense/MoE x fp32/bf16 x flag)
  diagnose       find the first op where training and rollout diverge
  plot-metrics   plot a run's verl file-logger JSONL (reward, acceptance, sequence KL, logdiff, step time)
"""

from __future__ import annotations

import sys


def _build_assets(argv: list[str]) -> int:
    import argparse

    from true_on_policy import tiny_assets

    parser = argparse.ArgumentParser(prog="python -m true_on_policy build-assets")
    parser.add_argument("--root", default=None, help=f"default: ${tiny_assets.ASSETS_ENV} or ~/.cache/true_on_policy")
    args = parser.parse_args(argv)
    root = tiny_assets.ensure_assets(args.root)
    print(f"assets ready under {root}")
    return 0


def _build_native(argv: list[str]) -> int:
    import argparse

    from true_on_policy.kernels import native

    argparse.ArgumentParser(prog="python -m true_on_policy build-native").parse_args(argv)
    lib = native.build()  # a compiler error propagates, with the compiler's output
    print(f"native kernels ready: {lib.__file__}")
    return 0


def _cpu_report(argv: list[str]) -> int:
    from true_on_policy.cli import cpu_report

    return cpu_report.main(argv)


def _fetch_keys(argv: list[str]) -> int:
    from true_on_policy.cli import fetch_keys

    return fetch_keys.main(argv)


def _check(argv: list[str]) -> int:
    from true_on_policy.cli.check import main

    return main(argv)


def _logdiff(argv: list[str]) -> int:
    from true_on_policy.cli import logdiff

    return logdiff.main(argv)


def _diagnose(argv: list[str]) -> int:
    from true_on_policy.cli.diagnose import main

    return main(argv)


def _plot_metrics(argv: list[str]) -> int:
    from true_on_policy.cli import plot_metrics

    return plot_metrics.main(argv)


COMMANDS = {
    "build-assets": _build_assets,
    "build-native": _build_native,
    "cpu-report": _cpu_report,
    "fetch-keys": _fetch_keys,
    "check": _check,
    "logdiff": _logdiff,
    "diagnose": _diagnose,
    "plot-metrics": _plot_metrics,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
