"""The linear: a fixed reduction tree over K, the same bits at every batch and tensor-parallel size.

:func:`linear` multiplies rows in fixed tiles (:mod:`.tiling`), the reduced dimension split into
:func:`k_leaves` leaves -- a function of the UNSHARDED size -- combined by :func:`tree_combine`, so a
row-parallel shard's product is a subtree and the ranks' subtrees combined are the unsharded bits.
:func:`pack_weight` / :func:`pack_experts` lay a weight out once for the native path; the same bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from true_on_policy.kernels import native
from true_on_policy.kernels.ops import tiling
from true_on_policy.kernels.ops.dispatch import _no_autocast, _route
from true_on_policy.kernels.ops.tiling import matmul_tiles, tile_rows
from true_on_policy.kernels.scope import MAX_TP

def k_leaves(k: int) -> int:
    """Leaves of the reduction tree over a linear's reduced dimension of ``k`` (the UNSHARDED size).

    The smallest power of two that is >= :data:`MAX_TP` and makes leaves <= :data:`K_CHUNK` wide,
    capped at the largest power of two dividing ``k`` (leaves are equal). A function of ``k`` alone,
    so a row-parallel rank holding ``k / t`` columns (t a power of two <= :data:`MAX_TP` dividing k)
    holds exactly ``leaves / t`` whole leaves: a complete subtree.
    """
    if k < 1:
        return 1
    wanted = max(MAX_TP, 1 << (-(-k // tiling.K_CHUNK) - 1).bit_length())
    return min(k & -k, wanted)


def tree_combine(parts: Iterable[torch.Tensor]) -> torch.Tensor:
    """The fixed pairwise tree over ``parts`` (a power-of-two count): adjacent pairs first.

    ``((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))``, elementwise fp32 adds, so the sum over a
    contiguous, aligned block of ``2^j`` parts is a subtree: a rank's partial of a row-parallel
    linear is one, and the ranks' partials combined here (in rank order) are the whole tree's top
    levels. ``parts`` is consumed in order, at most log2(n) + 1 partial sums alive.
    Bits: the project's order.
    """
    stack: list[tuple[int, torch.Tensor]] = []  # (parts below, their sum)
    count = 0
    for part in parts:
        count += 1
        size = 1
        while stack and stack[-1][0] == size:
            part = stack.pop()[1] + part
            size *= 2
        stack.append((size, part))
    if not count or count & (count - 1):
        raise ValueError(f"tree_combine: needs a power-of-two number of parts, got {count}")
    return stack[0][1]


def matmul_tree(a: torch.Tensor, b: torch.Tensor, leaves: int) -> torch.Tensor:
    """fp32 ``a @ b`` for ``a`` [G, R, K], ``b`` [G, K, N], K split into ``leaves`` equal leaves.

    Each leaf is :func:`matmul_tiles` (one bmm per K chunk of the leaf, added in order), the leaves
    are combined by :func:`tree_combine`. Row invariance as :func:`matmul_tiles`; and the product of
    a contiguous, aligned block of ``2^j`` leaves is exactly that subtree of the whole product's tree.
    Bits: rest on mkl_sgemm (its leaves' bmm).
    """
    k = a.shape[-1]
    width = k // leaves
    if width * leaves != k:
        raise ValueError(f"matmul_tree: K = {k} does not split into {leaves} equal leaves")
    return tree_combine(matmul_tiles(a[..., s : s + width], b[:, s : s + width]) for s in range(0, k, width))


def local_leaves(k: int, k_parts: int) -> int:
    """Leaves of one of ``k_parts`` equal shards of a reduced dimension of ``k * k_parts`` (see :func:`k_leaves`)."""
    if k_parts < 1 or k_parts & (k_parts - 1) or k_parts > MAX_TP:
        raise ValueError(
            f"linear: k_parts={k_parts}; a row-parallel split must be a power of two <= MAX_TP={MAX_TP}"
        )
    leaves = k_leaves(k * k_parts)
    if leaves % k_parts:
        raise ValueError(
            f"linear: a reduced dimension of {k * k_parts} has {leaves} tree leaves, which {k_parts} shards "
            "cannot hold as whole subtrees"
        )
    return leaves // k_parts


def linear_epilogue(acc: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The end of every linear: fp32 ``acc`` + bias in fp32, then one cast to ``out_dtype``.

    Bits: the project's order.
    """
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc if out_dtype == torch.float32 else acc.to(out_dtype)


@dataclasses.dataclass(frozen=True)
class WeightPack:
    """A weight [N, K] laid out once for the native path :func:`linear` takes on it (``path``): "dot" (bf16
    16-column panels, pairs of k interleaved, and their values' exponent range) or "chain" (64-row groups, each
    as 4 strips of 16 rows of the transpose, in ``parts`` row blocks each from a group's start). A relayout, no
    arithmetic: a product given it computes the bits it computes from the weight. Valid while the weight is
    unchanged; whoever writes the weight drops its pack."""

    shape: tuple[int, int]
    path: str
    tensors: tuple[torch.Tensor, ...]
    parts: int = 1  # a linear reads a pack of one part; the experts' gate_up packs have two


def pack_weight(weight: torch.Tensor, parts: int = 1) -> WeightPack | None:
    """``weight``'s :class:`WeightPack` for the native path a linear of its dtype takes on it (an fp32 or bf16
    weight [N, K] on CPU, whose ``parts`` row blocks are each a linear of N / ``parts`` >= FMA_CHAIN_MIN_N
    features), else None (the linear then reads the weight as it is; a narrow weight is padded first)."""
    if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16) or weight.shape[0] % parts:
        return None
    block = weight[: weight.shape[0] // parts]
    path = _route("linear", weight.device, weight.dtype, block, weight.shape[1]).path
    if path == "dot" and parts == 1:
        return WeightPack(tuple(weight.shape), path, tuple(native.lib().pack_dot_weight(weight)))
    if path == "chain":
        return WeightPack(tuple(weight.shape), path, (native.lib().pack_chain_weight(weight, parts),), parts)
    return None


def pack_experts(gate_up, down) -> tuple[list[WeightPack], list[WeightPack]] | None:
    """The experts' weights laid out once for :func:`moe.moe_experts`' native call (gate_up packs, down packs), or
    None where it reads none: every weight's :func:`pack_weight`, gate_up's gate and up rows each from a group's
    start on the chain path (which an expert of few rows reads instead of laying its weights out in every call)."""
    if len(gate_up) == 0:
        return None
    weight = gate_up[0]
    parts = 2 if _route("linear", weight.device, weight.dtype, weight, weight.shape[1]).path == "chain" else 1
    packs = ([pack_weight(w, parts) for w in gate_up], [pack_weight(w) for w in down])
    paths = {p.path if p is not None else None for p in packs[0] + packs[1]}
    return packs if len(paths) == 1 and None not in paths else None


def _linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype,
                    k_parts: int = 1, pack: WeightPack | None = None) -> torch.Tensor:
    k = x.shape[-1]
    n = weight.shape[0]
    leaves = local_leaves(k, k_parts)
    if pack is not None and pack.shape != tuple(weight.shape):
        raise ValueError(f"linear: a pack of a weight {list(pack.shape)} for a weight {list(weight.shape)}")
    narrow = n < native.FMA_CHAIN_MIN_N
    if narrow:  # zero output features appended: MKL runs its N-invariant fma-chain kernel from 12 columns
        weight = F.pad(weight, (0, 0, 0, native.FMA_CHAIN_MIN_N - n))
        if bias is not None:
            bias = F.pad(bias, (0, native.FMA_CHAIN_MIN_N - n))
    out = _padded_linear_forward(x, weight, bias, out_dtype, leaves, pack)
    return out[..., :n] if narrow else out


def _padded_linear_forward(x, weight, bias, out_dtype, leaves: int, pack: WeightPack | None = None) -> torch.Tensor:
    k = x.shape[-1]
    n = weight.shape[0]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    height = tile_rows(m, k, n, tiling.TILE_ROWS, x.device, leaves)
    with _no_autocast(x.device):
        # from C++: the same entries as fma chains where MKL's are (checked), bf16 read as bf16 by the
        # dot-product instruction where it was checked (the same fma chains), else the same aten calls
        kernel = _route("linear", x.device, x.dtype, weight, k // leaves)
        if kernel.path == "tiles":
            return kernel.run(x, weight, bias, out_dtype, height, tiling.K_CHUNK, leaves)
        if kernel.run:
            packed = pack.tensors if pack is not None and pack.path == kernel.path and pack.parts == 1 else None
            return kernel.run(x, weight, bias, out_dtype, tiling.K_CHUNK, leaves, packed)
        if m == 0:
            return x.new_zeros(*x.shape[:-1], n, dtype=out_dtype)
        tiles = -(-m // height)
        if tiles * height != m:  # zero rows appended; one copy does the fp32 cast too
            a = rows.new_zeros(tiles * height, k, dtype=torch.float32)
            a[:m] = rows
        else:
            a = rows.to(torch.float32)
        a = a.view(tiles, height, k)
        w = weight.to(torch.float32)
        if w.is_contiguous():  # W^T repeated for every tile without a copy
            b = w.as_strided((tiles, k, n), (0, 1, k))
        else:
            b = w.t().unsqueeze(0).expand(tiles, k, n)
        out = matmul_tree(a, b, leaves).view(tiles * height, n)[:m]
        return linear_epilogue(out, bias, out_dtype).view(*x.shape[:-1], n)


class _Linear(torch.autograd.Function):
    """Forward: the tile kernel. Backward: plain matmuls (gradients need not be batch-invariant)."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype, k_parts):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return _linear_forward(x, weight, bias, out_dtype, k_parts)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        k, n = x.shape[-1], weight.shape[0]
        g = grad.reshape(-1, n).to(torch.float32)
        grad_x = grad_w = grad_b = None
        with _no_autocast(grad.device):
            if ctx.needs_input_grad[0]:
                grad_x = (g @ weight.to(torch.float32)).to(x.dtype).view(x.shape)
            if ctx.needs_input_grad[1]:
                grad_w = (g.t() @ x.reshape(-1, k).to(torch.float32)).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = g.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    k_parts: int = 1,
    pack: WeightPack | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with a per-row result independent of the batch and of TP sharding.

    Invariant: rows are padded to tiles of :data:`TILE_ROWS` (or :func:`tile_rows`' shorter
    tile, with the same row bits) and multiplied in fp32 by :func:`matmul_tree` -- the reduced dim
    split into :func:`k_leaves` leaves (each in :data:`K_CHUNK` chunks added in order) combined by a
    fixed pairwise tree -- the bias is added in fp32, and the output is cast once to ``out_dtype``
    (default: ``x``'s dtype). So a row's output is the same bits for any number of rows (1 = decode,
    thousands = training), any position in the batch and 1 or 2 threads. Each entry is computed
    alone (fewer than 12 output features get zero features appended: MKL's kernel for narrow
    products differs), so a column-parallel shard computes its columns' bits.

    ``k_parts`` > 1: ``weight`` holds one of ``k_parts`` contiguous shards of the reduced dim (a
    row-parallel rank); the result is that shard's subtree. :func:`tree_combine` of all ranks'
    fp32 subtrees, in rank order, then :func:`linear_epilogue` is bitwise the unsharded linear.

    ``pack``: ``weight``'s :func:`pack_weight`, for an inference engine whose weights change only when
    it loads them: the same bits, without laying the weight out again in every call (a pack for another
    path than this call's is not read).
    Bits: the torch code's rest on mkl_sgemm; the native chain and dot routes compute the project's fma
    chains (taken where the load-time check found MKL computing them), the tiles route the torch code's bmm.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    needs_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if needs_grad and torch.is_grad_enabled():
        return _Linear.apply(x, weight, bias, out_dtype, k_parts)
    return _linear_forward(x, weight, bias, out_dtype, k_parts, pack)
