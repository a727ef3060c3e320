"""The table of scripts/vllm_matrix.sh: release x case -> max |logdiff| with the flag on / its flag-off twin
(``skip``: the stock engine cannot run the case, with the reason in the JSON), and the verl e2e verdict.

    python scripts/vllm_matrix_table.py OUT_DIR RELEASE [RELEASE ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _cell(records: list[dict], flag: bool) -> str:
    found = [r for r in records if r["deterministic"] is flag]
    if not found:
        return "-"
    if "skipped" in found[0]:
        return "skip"
    return f"{found[0]['max_abs_diff']:.3g}"


def _cases(out: Path, release: str) -> dict[str, str]:
    cases: dict[str, list[dict]] = {}
    for group in ("dense", "moe"):
        path = out / f"{group}-{release}.json"
        for record in json.loads(path.read_text()) if path.exists() else []:
            layout = f"TP{record['tp']}" + (f"+EP{record['ep']}" if record["ep"] > 1 else "")
            dtype = {"float32": "fp32", "bfloat16": "bf16"}[record["dtype"]]
            cases.setdefault(f"{record['model']} {dtype} {layout}", []).append(record)
    row = {case: f"{_cell(rs, True)} / {_cell(rs, False)}" for case, rs in cases.items()}
    rc = out / f"e2e-{release}" / "rc"
    row["verl e2e (cpu_tiny_vllm)"] = ("0 mismatched tokens every step" if rc.exists() and rc.read_text().strip() == "0"
                                       else "FAILED" if rc.exists() else "-")
    return row


def main(argv: list[str]) -> int:
    out, releases = Path(argv[0]), argv[1:]
    rows = {release: _cases(out, release) for release in releases}
    cases = sorted({case for row in rows.values() for case in row}, key=lambda c: (c.startswith("verl"), c))
    print("| case (max abs logdiff: flag on / flag off) | " + " | ".join(releases) + " |")
    print("|---|" + "---|" * len(releases))
    for case in cases:
        print(f"| {case} | " + " | ".join(rows[r].get(case, "-") for r in releases) + " |")
    # failed: the flag on not 0, a flag-off twin that shows no difference, an e2e run not 0 at every step
    failed = [r for r, row in rows.items() for case, cell in row.items()
              if cell == "FAILED" or (not case.startswith("verl") and (cell.split(" / ")[0] not in ("0", "-")
                                                                        or cell.split(" / ")[1] == "0"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
