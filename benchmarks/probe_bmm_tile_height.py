"""Probe: does a row of an fp32 ``torch.bmm`` keep its bits when the tile height R shrinks?

The consistent kernels multiply in row tiles of a fixed height (``ops.TILE_ROWS`` = 64 for linears,
``ops.ATTN_TILE_ROWS`` = 32 for attention), so a decode step pads 1-8 live rows to a full tile and
pays for the rest. ``ops.tile_rows`` lets such a call use a tile of ``ops.SHORT_TILE_ROWS`` rows
where torch's bmm runs BLAS at that height (R * K * N >= ``ops.BLAS_MIN_WORK``; below it torch runs a
naive loop). This probe computes ``bmm(a[:, :R], b)`` against the rows of ``bmm(a, b)`` with R = 64,
over reduced sizes K <= ``ops.K_CHUNK``, output widths N, batch counts G, a transposed (stride-0, as
``ops.linear`` passes W^T) or plain right operand, and 1 and 2 threads, and prints, per R, how many
shape sets differ (``torch.equal``) on the BLAS path and below it, with examples.
Usage: python benchmarks/probe_bmm_tile_height.py [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from true_on_policy.kernels import ops

HEIGHTS = (1, 2, 4, 8, 16, 24, 32, 48, 56)
SHAPES = dict(K=(1, 5, 16, 17, 64, 72, 100, 128), N=(1, 4, 17, 64, 65, 129, 1000), G=(1, 3, 40), transposed=(False, True))


def probe() -> list[dict]:
    differs = {(r, blas): [] for r in HEIGHTS for blas in (True, False)}
    counts = dict.fromkeys(differs, 0)
    sets = 0
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for k, n, g, transposed in itertools.product(*SHAPES.values()):
            gen = torch.Generator().manual_seed(sets)
            sets += 1
            a = torch.randn(g, 64, k, generator=gen)
            b = torch.randn(n, k, generator=gen).as_strided((g, k, n), (0, 1, k)) if transposed else torch.randn(g, k, n, generator=gen)
            full = torch.bmm(a, b)
            for r in HEIGHTS:
                key = (r, r * k * n >= ops.BLAS_MIN_WORK)
                counts[key] += 1
                if not torch.equal(torch.bmm(a[:, :r].contiguous(), b), full[:, :r]):
                    differs[key].append(dict(threads=threads, K=k, N=n, G=g, transposed=transposed))
    return [
        dict(case=f"bmm_rows/R{r}_vs_R64/{'blas' if blas else 'below_blas'}", shape_sets=counts[(r, blas)],
             differing=len(d), short_tile=r in ops.SHORT_TILE_ROWS, examples=d[:3])
        for (r, blas), d in differs.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    for record in probe():
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(f"{record['case']:34s} {record['differing']:4d} of {record['shape_sets']:4d} shape sets differ"
                  f"  e.g. {record['examples'][:1]}")


if __name__ == "__main__":
    main()
