"""The fixed tiling every product of the ops is computed in: row tiles, K chunks, KV blocks.

A product's row sees neither how many rows its batch has nor the thread count, on two rules: rows in
tiles of a fixed height (:data:`TILE_ROWS`, :data:`ATTN_TILE_ROWS`; a call with few rows may take
:func:`tile_rows`' shorter tile, which keeps the full tile's bits), and the reduced dimension in chunks of
at most :data:`K_CHUNK` whose partials are added in order (:func:`matmul_tiles`). The other ops modules
read these constants as ``tiling.NAME`` at call time, so one value holds for every op.
"""

from __future__ import annotations

import torch

TILE_ROWS = 64  # rows of one linear-layer tile: a row never sees how many rows its batch has
ATTN_TILE_ROWS = 32  # query rows (heads x positions) of one attention tile
K_CHUNK = 128  # the reduced dimension of every bmm is split into chunks of at most this size
KV_BLOCK = 64  # attention's KV block, aligned at absolute positions [j*KV_BLOCK, (j+1)*KV_BLOCK)
SHORT_TILE_ROWS = (4, 8, 16, 32)  # the shorter tiles a call with few rows (decode) may use on CPU
BLAS_MIN_WORK = 400  # below R * K * N = 400 torch's CPU bmm runs a naive loop, not BLAS: other row bits


def tile_rows(m: int, k: int, n: int, full: int, device: torch.device, leaves: int = 1) -> int:
    """Height of the row tiles of an [m, k] @ [k, n] product whose tile is ``full`` rows high.

    On CPU a call with few rows (decode) uses the shortest of :data:`SHORT_TILE_ROWS` that holds
    them, iff torch's bmm takes its BLAS path at that height for every product it runs -- each K chunk
    of each of the ``leaves`` tree leaves (:func:`matmul_tree`; R * chunk * N >= :data:`BLAS_MIN_WORK`).
    On that path a row's bits are the same for every tile height R >= 4
    -- MKL computes each entry as one fma chain over k (``tests/unit/test_native_ops.py``) -- while
    R = 1, 2 and the naive loop differ (``benchmarks/probe_bmm_tile_height.py``), so the row keeps
    the full tile's bits at a fraction of its work. Anywhere else (other devices, many rows): ``full``.
    """
    if m < full and device.type == "cpu":
        leaf = k // leaves
        k_min = leaf % K_CHUNK or min(leaf, K_CHUNK)  # the shortest chunk: a leaf's tail, if any
        for r in SHORT_TILE_ROWS:
            if m <= r < full and r * k_min * n >= BLAS_MIN_WORK:
                return r
    return full


def matmul_tiles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 ``a @ b`` for ``a`` [G, R, K], ``b`` [G, K, N]: one bmm per K chunk, partials added in order.

    Invariant: entry (g, r, n) depends only on row ``a[g, r]`` and ``b[g]`` -- not on G, on r, on
    the other rows, or on the thread count -- as long as R and N are fixed by the caller. Each
    chunk's reduced dim is <= :data:`K_CHUNK` (measured: a bmm of K <= 128 keeps a row's result
    for any batch count and 1 or 2 threads; an unsplit K = 1024 does not), and the chunk partials
    are summed left to right with elementwise adds. (Attention's products; a linear's are
    :func:`matmul_tree`, whose leaves are these.)
    Bits: rest on mkl_sgemm (each chunk's bmm).
    """
    k = a.shape[-1]
    if k <= K_CHUNK:
        return torch.bmm(a, b)
    out = None
    for start in range(0, k, K_CHUNK):
        part = torch.bmm(a[..., start : start + K_CHUNK], b[:, start : start + K_CHUNK])
        out = part if out is None else out + part
    return out
