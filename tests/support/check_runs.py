"""For the tests of ``python -m true_on_policy check`` and the determinism plan: the command run in this
process, the rows its UNVERIFIED lines name, and an importer that finds no vLLM."""

from __future__ import annotations

import io

from true_on_policy.cli import check


def run_check(argv: list[str]) -> tuple[int, str, str]:
    """``python -m true_on_policy check ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = check.main(argv, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def unverified_fields(stderr: str) -> set[str]:
    """The contract rows named by ``check``'s ``UNVERIFIED [field]`` lines."""
    return {line.split("[", 1)[1].split("]", 1)[0] for line in stderr.splitlines() if line.startswith("UNVERIFIED ")}


def no_vllm(name):
    """An ``importer=`` for the determinism plan on a machine without vLLM (declared versions stand in)."""
    raise ImportError(name)
