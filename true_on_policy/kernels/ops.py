"""The consistent kernels: one order-fixed implementation per op, used by both engines.

Every op's result for a row is bitwise independent of the batch size and composition, the row's
position, the sequence position, micro-batching and the thread count, on four rules: visible
tokens by selection, never an additive mask; every reduction in a fixed order (fixed row tiles,
fixed K chunks, a fixed pairwise tree whose leaves depend on the unsharded size, so every TP up to
:data:`MAX_TP` gives the same bits); one online-softmax cadence for training and decode; fp32 at
the sensitive points, outputs cast once. Each op's docstring states its invariant.

One switch (:class:`Switches`: the flag models read, the native kernels, :class:`Fault` switches for
diagnosis) is set by :func:`set_switches` or :func:`switched`; the ops always compute the consistent way,
except under fault switches. One table (:data:`ROUTES`, read by :func:`_route` alone) says which
implementation computes an op: on CPU some ops call :mod:`.native` (C++), the same bits; this torch code
stays the specification.
Pure torch; no verl, no transformers import. Details: docs/true_on_policy.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

from true_on_policy.kernels import architectures, native
from true_on_policy.kernels.scope import KERNEL_DTYPES, MAX_TP

__all__ = [
    "TILE_ROWS",
    "ATTN_TILE_ROWS",
    "SHORT_TILE_ROWS",
    "BLAS_MIN_WORK",
    "tile_rows",
    "K_CHUNK",
    "KV_BLOCK",
    "Switches",
    "switches",
    "set_switches",
    "switched",
    "enabled",
    "consistent",
    "ROUTES",
    "fixed_sum",
    "matmul_tiles",
    "matmul_tree",
    "MAX_TP",
    "k_leaves",
    "local_leaves",
    "tree_combine",
    "linear",
    "WeightPack",
    "pack_experts",
    "pack_weight",
    "linear_epilogue",
    "rms_norm",
    "silu",
    "silu_mul",
    "sigmoid",
    "sigmoid_gate",
    "rope_table",
    "text_positions",
    "apply_rope",
    "attention",
    "attention_plan",
    "PagedKV",
    "paged_attention",
    "AttentionPlan",
    "moe_route",
    "moe_experts",
    "moe_select",
    "moe_combine",
    "log_softmax",
    "token_log_probs",
    "Fault",
    "DTYPES",
]

TILE_ROWS = 64  # rows of one linear-layer tile: a row never sees how many rows its batch has
ATTN_TILE_ROWS = 32  # query rows (heads x positions) of one attention tile
K_CHUNK = 128  # the reduced dimension of every bmm is split into chunks of at most this size
KV_BLOCK = 64  # attention's KV block, aligned at absolute positions [j*KV_BLOCK, (j+1)*KV_BLOCK)
DTYPES = {name: getattr(torch, name) for name in KERNEL_DTYPES}  # the dtypes the kernels compute in, by name

# ----------------------------------------------------------------------------------------------
# The one switch
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fault:
    """Switches that break a rule on purpose, for :mod:`true_on_policy.diagnose`'s fault injection only.

    They act on the real kernels below (never on copies, which would drift from them), forward only;
    all off (the default) leaves every op and every bit unchanged.
    """

    softmax_dtype: torch.dtype | None = None  # rule 4 broken: attention's softmax accumulated in this dtype
    additive_mask: bool = False  # rule 1 broken: invisible keys get + -1e9 instead of being selected away
    kv_garbage: bool = False  # unwritten KV slots hold NaN, like an uninitialised paged cache
    router_ties_to_higher: bool = False  # MoE top-k ties broken towards the HIGHER expert index


NO_FAULT = Fault()


@dataclasses.dataclass(frozen=True)
class Switches:
    """The ops' one switch, process-wide: read by :func:`switches`, set by :func:`set_switches` (a worker, once)
    or :func:`switched` (a scope).

    ``consistent``: models patched by :mod:`.model` run on these ops (:func:`enabled`). ``native``: CPU ops run
    their C++ kernels (:data:`ROUTES`) where those compute the specification's bits; off, the torch code runs
    (the reference the C++ is held equal to). ``fault``: :class:`Fault` switches (diagnosis only).
    """

    consistent: bool = False
    native: bool = True
    fault: Fault = NO_FAULT


_SWITCHES = Switches()


def switches() -> Switches:
    """The switches in force."""
    return _SWITCHES


def set_switches(**changes) -> Switches:
    """Set the named :class:`Switches` fields (``consistent=``, ``native=``, ``fault=``); return the previous ones."""
    global _SWITCHES
    previous, _SWITCHES = _SWITCHES, dataclasses.replace(_SWITCHES, **changes)
    return previous


@contextlib.contextmanager
def switched(**changes) -> Iterator[Switches]:
    """Context manager: the named :class:`Switches` fields set inside, restored on exit."""
    previous = set_switches(**changes)
    try:
        yield _SWITCHES
    finally:
        set_switches(**{name: getattr(previous, name) for name in changes})


def enabled() -> bool:
    """Whether models patched by :mod:`.model` run on these ops (``switches().consistent``)."""
    return _SWITCHES.consistent


def consistent(value: bool = True) -> contextlib.AbstractContextManager[Switches]:
    """``switched(consistent=value)``: the engines' scope of the flag."""
    return switched(consistent=value)


# ----------------------------------------------------------------------------------------------
# Dispatch: the one table of which implementation computes an op
# ----------------------------------------------------------------------------------------------


class Route(NamedTuple):
    """A C++ CPU kernel of an op: ``path`` (its name among the op's kernels), ``entry`` (the library's function)
    and ``premise``: given the op's arguments, the library (:mod:`.native`) where ``entry`` computes the
    specification's bits for them, else a false value -- a library check, a width, dtypes, autograd, faults."""

    path: str
    entry: str
    premise: Callable[..., ModuleType | None]


class Kernel(NamedTuple):
    """What :func:`_route` chose: ``path`` ("torch": the specification) and the library function to call."""

    path: str
    run: Callable | None


SPECIFICATION = Kernel("torch", None)


def _inference(*tensors: torch.Tensor) -> bool:
    """Whether no autograd graph records through ``tensors`` (the C++ kernels are forward-only)."""
    if torch.is_grad_enabled():
        for tensor in tensors:
            if tensor.requires_grad:
                return False
    return True


def _unfaulted(library):  # the fault switches act on the torch code only
    return library if _SWITCHES.fault == NO_FAULT else None


def _fits_fixed_sum(x):
    return x.dtype == torch.float32 and native.lib()


def _fits_rms_norm(x, weight, unit_offset):  # the C++ kernel multiplies by the weight itself, not 1 + weight
    return not unit_offset and _inference(x, weight) and native.lib()


def _fits_silu_mul(gate, up):
    if gate.dtype != up.dtype or gate.dtype not in (torch.float32, torch.bfloat16) or gate.shape != up.shape:
        return None
    return _inference(gate, up) and native.lib()


# a linear's premises: x's dtype, a weight [N, K] (N >= FMA_CHAIN_MIN_N where it runs: narrower ones are padded),
# k_per_leaf = K / leaves
def _fits_linear_dot(x_dtype, weight, k_per_leaf):  # bf16 read as bf16 where vdpbf16ps was checked; pairs of k
    if x_dtype == weight.dtype == torch.bfloat16 and k_per_leaf % 2 == 0:
        return native.fma_chain_lib(weight.shape[0]) and native.bf16_dot_lib()
    return None


def _fits_linear_chain(x_dtype, weight, k_per_leaf):  # MKL's fma chains, checked for N columns
    return native.fma_chain_lib(weight.shape[0])


def _fits_linear_tiles(x_dtype, weight, k_per_leaf):  # the torch code's aten calls, from C++
    return native.lib()


def _fits_attention(q):  # the products' widths: KV_BLOCK and head dim + 1 (the denominator's column)
    return _unfaulted(native.fma_chain_lib(q.shape[-1] + 1))


def _fits_paged_attention(q, kv):  # the cache read in place: fp32 or bf16, keys and values laid out alike
    if kv.key_cache.dtype not in (torch.float32, torch.bfloat16) or kv.key_cache.stride() != kv.value_cache.stride():
        return None
    return _fits_attention(q)


def _fits_attention_backward(grad_out, plan):
    """Every product of the backward has ``live`` >= 4 rows, a width (head dim, KV_BLOCK) on the fma-chain path,
    >= BLAS_MIN_WORK multiply-adds and a reduced dim (head dim, KV_BLOCK, live) <= K_CHUNK: the torch code's
    backward does not split it, and MKL is one fma chain only up to that length."""
    live, D = plan.dims[8], grad_out.shape[-1]
    if live < SHORT_TILE_ROWS[0] or live * D * plan.B < BLAS_MIN_WORK or max(D, plan.B, live) > K_CHUNK:
        return None
    return native.fma_chain_lib(D)


def _moe_in_one_call(hidden, gate_up, down, k_parts, experts) -> bool:
    """:func:`moe_experts` as one native call: inference, unsharded, hidden and weights of one dtype."""
    if k_parts != 1 or experts is not None or hidden.dim() != 2 or len(gate_up) == 0:
        return False
    dtype = hidden.dtype
    if dtype not in (torch.float32, torch.bfloat16) or not dtype == gate_up[0].dtype == down[0].dtype:
        return False
    return _inference(hidden, gate_up[0], down[0])


def _fits_moe_dot(hidden, gate_up, down, k_parts, experts, packs):  # every expert packed; whole column groups
    if hidden.dtype != torch.bfloat16 or not _moe_in_one_call(hidden, gate_up, down, k_parts, experts):
        return None
    if packs is None or (library := native.bf16_dot_lib()) is None:
        return None
    return library if gate_up[0].shape[0] % (2 * native.constants()["dot_group"]) == 0 else None


def _fits_moe_chain(hidden, gate_up, down, k_parts, experts, packs):  # bf16 only where there is no dot path
    if not _moe_in_one_call(hidden, gate_up, down, k_parts, experts):
        return None
    if hidden.dtype == torch.bfloat16 and native.bf16_dot_lib() is not None:
        return None
    return native.fma_chain_lib(min(gate_up[0].shape[0], down[0].shape[0]))


def _fits_delta_rule(q, k, v, decay, beta, state):  # fp32 * + - and the fixed tree: no CPU premise
    return _inference(q, k, v, decay, beta, state) and native.lib()


# op -> its C++ CPU kernels, tried in order: the first whose premise holds runs. Where none holds, on any other
# device (whose kernels are the torch ops themselves) and with ``switches().native`` off, the op's torch code --
# the specification, which every C++ kernel is held torch.equal to -- runs. A premise takes the op's arguments.
ROUTES: dict[str, tuple[Route, ...]] = {
    "fixed_sum": (Route("native", "fixed_sum", _fits_fixed_sum),),
    "rms_norm": (Route("native", "rms_norm", _fits_rms_norm),),
    "silu_mul": (Route("native", "silu_mul", _fits_silu_mul),),
    "linear": (Route("dot", "linear_dot", _fits_linear_dot), Route("chain", "linear_chain", _fits_linear_chain),
               Route("tiles", "linear_tiles", _fits_linear_tiles)),
    "attention": (Route("native", "attention", _fits_attention),),
    "attention_backward": (Route("native", "attention_backward", _fits_attention_backward),),
    "paged_attention": (Route("native", "attention", _fits_paged_attention),),
    "moe_experts": (Route("dot", "moe_experts", _fits_moe_dot), Route("chain", "moe_experts_chain", _fits_moe_chain)),
    "delta_rule": (Route("native", "delta_rule", _fits_delta_rule),),  # gated_delta.delta_rule's core
}


def _route(op: str, device: torch.device, *args) -> Kernel:
    """The implementation of ``op`` (a key of :data:`ROUTES`) for ``args`` on ``device``: the first C++ kernel
    whose premise holds, else :data:`SPECIFICATION`. The one place the ops' dispatch is decided."""
    if device.type != "cpu" or not _SWITCHES.native:
        return SPECIFICATION
    for route in ROUTES[op]:
        if library := route.premise(*args):
            if (kernel := _BOUND.get(route.entry)) is None:
                kernel = _BOUND[route.entry] = Kernel(route.path, getattr(library, route.entry))
            return kernel
    return SPECIFICATION


_BOUND: dict[str, Kernel] = {}  # a route's entry -> its Kernel (native.lib() is loaded once per process)


def _no_autocast(device: torch.device):
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------
# Reductions
# ----------------------------------------------------------------------------------------------


def fixed_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, keepdim, as a fixed pairwise tree of elementwise adds.

    Invariant: element ``i`` is paired with ``i + n/2`` (zero-padded to a power of two) at every
    level, so a row's sum depends only on the row's values, never on the number of rows, the
    row's position, the threads or the vector width (elementwise adds are correctly rounded).
    Its gradient is the one autograd derives through the tree (:class:`_FixedSum`).
    """
    if x.requires_grad and torch.is_grad_enabled():
        return _FixedSum.apply(x)
    return _fixed_sum(x)


def _fixed_sum(x: torch.Tensor) -> torch.Tensor:
    if (kernel := _route("fixed_sum", x.device, x)).run:
        return kernel.run(x)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = torch.add(x[..., :width], x[..., width:])
    return x


class _FixedSum(torch.autograd.Function):
    """:func:`fixed_sum` as one autograd node with the tree's own gradient, bitwise.

    Through the tree, autograd hands every element the row's gradient: an add passes it on, and each
    level's two slice gradients (zeros elsewhere) are accumulated by adding -- ``g + 0``, which keeps
    every value but turns -0.0 into +0.0 (``n == 1``: no level, ``g`` as is; NaN stays NaN, its
    payload is not kept by torch's bf16 adds anyway). One op instead of ~4 per level, forward and backward.
    """

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return _fixed_sum(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.expand(ctx.shape)
        return grad + 0.0 if ctx.shape[-1] > 1 else grad.clone()


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
    """
    k = a.shape[-1]
    if k <= K_CHUNK:
        return torch.bmm(a, b)
    out = None
    for start in range(0, k, K_CHUNK):
        part = torch.bmm(a[..., start : start + K_CHUNK], b[:, start : start + K_CHUNK])
        out = part if out is None else out + part
    return out


# ----------------------------------------------------------------------------------------------
# Linear: a fixed reduction tree over K, the same bits at every tensor-parallel size
# ----------------------------------------------------------------------------------------------


def k_leaves(k: int) -> int:
    """Leaves of the reduction tree over a linear's reduced dimension of ``k`` (the UNSHARDED size).

    The smallest power of two that is >= :data:`MAX_TP` and makes leaves <= :data:`K_CHUNK` wide,
    capped at the largest power of two dividing ``k`` (leaves are equal). A function of ``k`` alone,
    so a row-parallel rank holding ``k / t`` columns (t a power of two <= :data:`MAX_TP` dividing k)
    holds exactly ``leaves / t`` whole leaves: a complete subtree.
    """
    if k < 1:
        return 1
    wanted = max(MAX_TP, 1 << (-(-k // K_CHUNK) - 1).bit_length())
    return min(k & -k, wanted)


def tree_combine(parts: Iterable[torch.Tensor]) -> torch.Tensor:
    """The fixed pairwise tree over ``parts`` (a power-of-two count): adjacent pairs first.

    ``((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))``, elementwise fp32 adds, so the sum over a
    contiguous, aligned block of ``2^j`` parts is a subtree: a rank's partial of a row-parallel
    linear is one, and the ranks' partials combined here (in rank order) are the whole tree's top
    levels. ``parts`` is consumed in order, at most log2(n) + 1 partial sums alive.
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
    """The end of every linear: fp32 ``acc`` + bias in fp32, then one cast to ``out_dtype``."""
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
    """The experts' weights laid out once for :func:`moe_experts`' native call (gate_up packs, down packs), or
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
    height = tile_rows(m, k, n, TILE_ROWS, x.device, leaves)
    with _no_autocast(x.device):
        # from C++: the same entries as fma chains where MKL's are (checked), bf16 read as bf16 by the
        # dot-product instruction where it was checked (the same fma chains), else the same aten calls
        kernel = _route("linear", x.device, x.dtype, weight, k // leaves)
        if kernel.path == "tiles":
            return kernel.run(x, weight, bias, out_dtype, height, K_CHUNK, leaves)
        if kernel.run:
            packed = pack.tensors if pack is not None and pack.path == kernel.path and pack.parts == 1 else None
            return kernel.run(x, weight, bias, out_dtype, K_CHUNK, leaves, packed)
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
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    needs_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if needs_grad and torch.is_grad_enabled():
        return _Linear.apply(x, weight, bias, out_dtype, k_parts)
    return _linear_forward(x, weight, bias, out_dtype, k_parts, pack)


# ----------------------------------------------------------------------------------------------
# Elementwise-ish ops
# ----------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False) -> torch.Tensor:
    """Qwen3RMSNorm: ``weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype)``, fp32 inside.

    Invariant: the sum of squares is :func:`fixed_sum` (fixed tree) and HF's ``x * rsqrt(v)``
    is ``x / sqrt(v)`` (div is correctly rounded, torch's fp32 sqrt measured position-invariant;
    torch's rsqrt kernel is not position-invariant in bf16). The casts are exactly HF's: fp32
    inside, back to the input dtype before the weight multiply (whose dtype promotion is HF's too).

    ``unit_offset``: Qwen3.5's RMSNorm (Gemma's): the normalized fp32 row times ``1.0 + weight.float()``
    in fp32, then one cast to ``x``'s dtype (the same normalization; only the weight step differs).
    """
    if (kernel := _route("rms_norm", x.device, x, weight, unit_offset)).run:
        return kernel.run(x, weight, eps)
    input_dtype = x.dtype
    h = x.to(torch.float32)
    if unit_offset:
        normed = h / torch.sqrt(fixed_sum(h * h) / h.shape[-1] + eps)
        return (normed * (1.0 + weight.to(torch.float32))).to(input_dtype)
    if not _inference(x, weight):
        variance = fixed_sum(h * h) / h.shape[-1]
        return weight * (h / torch.sqrt(variance + eps)).to(input_dtype)
    # inference: the same ops, in place on the fresh intermediates
    root = fixed_sum(h * h).div_(h.shape[-1]).add_(eps).sqrt_()
    return weight * torch.div(h, root).to(input_dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` computed as ``x / (1 + exp(-x))`` in fp32, cast once to ``x``'s dtype.

    Invariant: built only from fp32 ``exp`` (measured position-invariant) and correctly rounded
    ``+`` and ``/``; torch's ``sigmoid``/``silu`` kernels give different bits in a tensor's tail.
    """
    h = x.to(torch.float32)
    return (h / (1.0 + torch.exp(-h))).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's ``silu(gate) * up``: :func:`silu`, then the product in the operands' dtype.

    Without autograd on CPU one native pass after torch's ``exp`` -- the same bits as this code.
    """
    if (kernel := _route("silu_mul", gate.device, gate, up)).run:
        return kernel.run(gate, up)
    return silu(gate) * up


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` in fp32 (torch's sigmoid kernel is not position-invariant; fp32 ``exp`` and
    correctly rounded ``+ /`` are)."""
    return 1.0 / (1.0 + torch.exp(-x.to(torch.float32)))


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` (Qwen3.5's gated attention output, the shared expert's gate), in ``x``'s dtype.

    transformers' rounding points: the sigmoid rounded to the operands' dtype (``torch.sigmoid`` of a
    tensor of that dtype), then the product in that dtype; the sigmoid itself is :func:`sigmoid`. ``x``
    and ``gate`` must share a dtype; ``gate`` broadcasts (the shared expert's gate is one column).
    """
    if gate.dtype != x.dtype:
        raise ValueError(f"sigmoid_gate: x is {x.dtype}, gate is {gate.dtype}; they must share a dtype")
    return x * sigmoid(gate).to(x.dtype)


def rope_table(config, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` [max_position_embeddings, :func:`architectures.rotary_dim`], computed once per model.

    Invariant: both engines index the SAME table by absolute position, so a position's rotation
    never depends on which other positions were computed with it (torch's ``cos``/``sin`` kernels
    are not guaranteed position-invariant). ``config``: a model config (mapping or transformers
    config). The frequencies are HF's: default RoPE, ``linear`` scaling (divided by its factor) or
    Llama-3's ``llama3`` scaling; any other rope type raises. Partial RoPE (Qwen3.5): the frequencies
    of ``rotary_dim`` features, as transformers' ``compute_default_rope_parameters``.
    """
    config = architectures.config_dict(config)
    params = architectures.rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise NotImplementedError(f"consistent ops: rope type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
    base = float(params["rope_theta"])
    try:
        dim = architectures.rotary_dim(config)
    except ValueError as error:
        raise NotImplementedError(f"consistent ops: {error}") from None
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float32) / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    positions = torch.arange(config["max_position_embeddings"], dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def text_positions(positions: torch.Tensor) -> torch.Tensor:
    """The 1-D positions of multimodal RoPE's position rows ``(3, ...)`` (temporal, height, width) for
    text: interleaved mRoPE of three equal rows is 1-D RoPE, so the first row. Rows that differ (image
    or video tokens) are refused: the consistent RoPE is 1-D."""
    if positions.dim() < 2 or positions.shape[0] != 3:
        raise ValueError(f"text_positions: expected mRoPE position rows (3, ...), got {tuple(positions.shape)}")
    if not (torch.equal(positions[0], positions[1]) and torch.equal(positions[0], positions[2])):
        raise NotImplementedError("consistent ops: multimodal RoPE with position rows that differ (image or video "
                                  "tokens) is not supported; text tokens only")
    return positions[0]


ROPE_TYPES = ("default", "linear", "llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1's frequency scaling, as transformers' ``_compute_llama3_parameters`` computes it."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in fp32, cast once to ``x``'s dtype.

    Invariant: elementwise, correctly rounded ops on fp32 values; ``cos``/``sin`` are rows of
    :func:`rope_table` (already broadcast by position), unsqueezed at ``unsqueeze_dim`` as HF does.
    Partial RoPE: only the first ``cos.shape[-1]`` features of a head rotate, the rest pass through
    unchanged (transformers' Qwen3.5 ``apply_rotary_pos_emb``).
    """
    c = cos.to(torch.float32).unsqueeze(unsqueeze_dim)
    s = sin.to(torch.float32).unsqueeze(unsqueeze_dim)
    rotated = c.shape[-1]
    if rotated == x.shape[-1]:
        h = x.to(torch.float32)
        return (h * c + _rotate_half(h) * s).to(x.dtype)
    h = x[..., :rotated].to(torch.float32)
    return torch.cat(((h * c + _rotate_half(h) * s).to(x.dtype), x[..., rotated:]), dim=-1)


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


class AttentionPlan:
    """Everything :func:`attention` derives from the layout alone (positions, valid slots, heads).

    Build it once per forward with :func:`attention_plan` and pass it to every layer's call; it
    holds the query tiles' positions, the (tile, block) pairs to compute and their visibility mask.
    """

    def __init__(self, q_positions: torch.Tensor, kv_valid: torch.Tensor, num_heads: int, num_kv_heads: int):
        if num_heads % num_kv_heads:
            raise ValueError(f"attention: {num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
        device = q_positions.device
        S, Tq = q_positions.shape
        Tk = kv_valid.shape[1]
        rep = num_heads // num_kv_heads
        rows = Tq * rep
        # the plan fixes the tile and block sizes of every call using it. A single tile (decode, short
        # prefill) is as short as its rows allow (see tile_rows) while both of its products -- scores
        # (K = head dim >= 1, N = KV_BLOCK) and PV (K = KV_BLOCK, N = head dim + 1) -- stay on the BLAS path.
        R = ATTN_TILE_ROWS
        if rows < ATTN_TILE_ROWS and device.type == "cpu":
            R = next(r for r in SHORT_TILE_ROWS if rows <= r and r * KV_BLOCK >= BLAS_MIN_WORK)
        self.R, self.B = R, B = R, KV_BLOCK
        n_blocks = max(-(-Tk // B), 1)
        if n_blocks * B != Tk:
            kv_valid = F.pad(kv_valid, (0, n_blocks * B - Tk), value=False)
        tiles = -(-rows // R)
        # query rows of one kv head: position-major, the group's `rep` heads interleaved, tiles of R
        rpos = q_positions[:, :, None].expand(S, Tq, rep).reshape(S, rows)
        if tiles * R != rows:
            rpos = F.pad(rpos, (0, tiles * R - rows), value=-1)
        rpos = rpos.view(S, tiles, R)
        # Elementwise work only on rows that can be real: a single tile (decode) holds `rows` of R.
        # Rows are independent in every elementwise op, so this changes no bit of a real row.
        live = rows if tiles == 1 else R
        rpos = rpos[:, :, :live]
        # (tile, block) pairs to compute: block j is skipped for a tile whose rows all lie before
        # it -- an exact no-op for those rows (see attention()), so skipping changes no bit.
        tile_hi = rpos.amax(dim=(0, 2))
        top = int(tile_hi.max())
        n_used = min(n_blocks, top // B + 1) if top >= 0 else 1
        needed = torch.arange(n_used, device=device)[None, :] * B <= tile_hi[:, None]
        self.dense = bool(needed.all())  # every tile needs every block (decode, short prefill)
        pair_t, pair_j = torch.nonzero(needed, as_tuple=True)
        key_pos = torch.arange(n_blocks * B, device=device).view(n_blocks, B)
        valid_blocks = kv_valid.view(S, n_blocks, B)
        # [S, pairs, live, B]: key visible to the row iff it holds a token at or before the row's position
        self.visible = (key_pos[pair_j][None, :, None, :] <= rpos[:, pair_t, :, None]) & valid_blocks[
            :, pair_j, None, :
        ]
        self.invisible = ~self.visible  # built once per plan, shared by every layer's call
        self.kv_valid = kv_valid
        self.kv_invalid = ~kv_valid
        self.pair_t, self.pair_j = pair_t, pair_j
        self.dims = (S, num_heads, Tq, num_kv_heads, Tk, rep, rows, tiles, live, n_blocks, n_used)


def attention_plan(
    q_positions: torch.Tensor, kv_valid: torch.Tensor, num_heads: int, num_kv_heads: int
) -> AttentionPlan:
    """The layout part of :func:`attention` for ``q_positions`` [S, Tq] and ``kv_valid`` [S, Tk]."""
    return AttentionPlan(q_positions, kv_valid, num_heads, num_kv_heads)


def _tiles_to_heads(x, plan: AttentionPlan):
    """[S, Hkv, tiles, live, D] query rows -> [S, Hq, Tq, D]."""
    S, Hq, Tq, Hkv, _, rep, rows, _, _, _, _ = plan.dims
    D = x.shape[-1]
    x = x.reshape(S, Hkv, -1, D)[:, :, :rows].reshape(S, Hkv, Tq, rep, D).transpose(2, 3)
    return x.reshape(S, Hq, Tq, D)


def _heads_to_tiles(x, plan: AttentionPlan, rows_per_tile: int):
    """[S, Hq, Tq, D] -> [S, Hkv, tiles, rows_per_tile, D] (zero rows appended), fp32."""
    S, Hq, Tq, Hkv, _, rep, rows, tiles, _, _, _ = plan.dims
    D = x.shape[-1]
    x = x.to(torch.float32).view(S, Hkv, rep, Tq, D).transpose(2, 3).reshape(S, Hkv, rows, D)
    if tiles * plan.R != rows:
        x = F.pad(x, (0, 0, 0, tiles * plan.R - rows))
    return x.view(S, Hkv, tiles, plan.R, D)[:, :, :, :rows_per_tile]


def _scatter_pairs(values, plan: AttentionPlan, fill: float):
    """[S, Hkv, pairs, ...] -> [S, Hkv, tiles, n_used, ...] with ``fill`` where a pair was skipped."""
    S, _, _, Hkv, _, _, _, tiles, _, _, n_used = plan.dims
    if plan.dense:
        return values.view(S, Hkv, tiles, n_used, *values.shape[3:])
    out = values.new_full((S, Hkv, tiles, n_used, *values.shape[3:]), fill)
    out[:, :, plan.pair_t, plan.pair_j] = values
    return out


def _identity(x):
    return x


def _key_value_blocks(k, v, plan: AttentionPlan, fault: Fault):
    """Keys as [S, Hkv, block, D, B]; values as [S, Hkv, block, B, D + 1] with invisible slots zeroed
    (0 * NaN would leak) and a ones column appended, so the PV product also accumulates the softmax
    denominator l. Both fp32, zero-padded to whole blocks."""
    S, _, _, Hkv, Tk, _, _, _, _, n_blocks, _ = plan.dims
    D, B = k.shape[-1], plan.B
    if n_blocks * B != Tk:
        k, v = F.pad(k, (0, 0, 0, n_blocks * B - Tk)), F.pad(v, (0, 0, 0, n_blocks * B - Tk))
    if fault.kv_garbage:
        slot_ok = plan.kv_valid[:, None, :, None]
        k, v = torch.where(slot_ok, k, math.nan), torch.where(slot_ok, v, math.nan)
    # (In-place writes into fresh buffers below compute the very same elementwise values as
    # out-of-place ops; they only save allocations, which dominate on CPU.)
    k_blocks = k.to(torch.float32).unflatten(2, (n_blocks, B)).transpose(-1, -2)  # a view
    if not plan.dense:  # gathered per pair: from a contiguous copy, the same values, faster
        k_blocks = k_blocks.contiguous()
    v_ext = v.new_empty(S, Hkv, n_blocks * B, D + 1, dtype=torch.float32)
    v_ext[..., :D] = v
    if not fault.additive_mask:  # (the additive-mask fault keeps them: it adds -1e9 instead of selecting)
        v_ext[..., :D].masked_fill_(plan.kv_invalid[:, None, :, None], 0.0)  # == where(valid, v, 0)
    v_ext[..., D] = 1.0
    return k_blocks, v_ext.view(S, Hkv, n_blocks, B, D + 1)


def _native_attention(attention_kernel, q, k, v, plan: AttentionPlan, scaling: float, keep_for_backward: bool):
    """:func:`_attention_kernel` (no faults) as one call into the fused C++ attention; the same bits.

    The backward state holds q, k, v themselves: the fused backward builds its tiles and blocks from
    them, and the torch backward (:func:`_torch_backward_operands`) only if it runs."""
    S, Hq, Tq, Hkv, Tk, rep, rows, tiles, live, n_blocks, n_used = plan.dims
    args = (q, k, v, scaling, plan.R, plan.B, tiles, live, n_used, plan.pair_t, plan.pair_j, plan.invisible)
    if not keep_for_backward:
        return attention_kernel(*args, plan.kv_invalid, K_CHUNK, False, None)[0], None
    out, probs, out_tiles = attention_kernel(*args, plan.kv_invalid, K_CHUNK, True, None)
    probs = probs.view(S, Hkv, plan.pair_t.numel(), live, plan.B)
    return out.to(q.dtype), dict(q=q, k=k, v=v, scaling=scaling, probs=probs, out_tiles=out_tiles)


def _attention_forward(q, k, v, plan: AttentionPlan, scaling: float, keep_for_backward: bool = False):
    """The forward of :func:`attention`: (out [S, Hq, Tq, D] in q's dtype, saved state or None), from the
    implementation :data:`ROUTES` picks. Reads the :class:`Fault` switches (all off outside fault injection)."""
    fault = _SWITCHES.fault
    if fault != NO_FAULT and keep_for_backward:
        raise RuntimeError(f"attention fault switches are forward-only (diagnosis), got {fault}")
    if (kernel := _route("attention", q.device, q)).run:
        return _native_attention(kernel.run, q, k, v, plan, scaling, keep_for_backward)
    return _attention_kernel(q, k, v, plan, scaling, fault, keep_for_backward)


def _rounding(fault: Fault):
    """The softmax's intermediate values as the fault holds them: in its dtype (in place: p shares its buffer
    with the GEMM operand), else as they are."""
    if fault.softmax_dtype is None:
        return _identity
    return lambda x: x.copy_(x.to(fault.softmax_dtype))


def _attention_kernel(q, k, v, plan: AttentionPlan, scaling: float, fault: Fault, keep_for_backward: bool):
    """:func:`_attention_forward`'s torch code: the specification, with ``fault``'s switches."""
    additive, rounded = fault.additive_mask, _rounding(fault)
    S, Hq, Tq, Hkv, Tk, rep, rows, tiles, live, n_blocks, n_used = plan.dims
    D = q.shape[-1]
    R, B = plan.R, plan.B
    pair_t, pair_j = plan.pair_t, plan.pair_j
    n_pairs = pair_t.numel()
    k_blocks, v_blocks = _key_value_blocks(k, v, plan, fault)

    def flat(x):  # [S, Hkv, pairs, a, b] -> [S * Hkv * pairs, a, b]
        return x.reshape(S * Hkv * n_pairs, *x.shape[-2:])

    def pairs_of_tiles(x):  # [S, Hkv, tiles, ...] -> [S, Hkv, pairs, ...]
        if plan.dense:
            return x[:, :, :, None].expand(S, Hkv, tiles, n_used, *x.shape[3:])
        return x.index_select(2, pair_t)

    def pairs_of_blocks(x):  # [S, Hkv, blocks, ...] -> [S, Hkv, pairs, ...]
        if plan.dense:
            return x[:, :, None, :n_used].expand(S, Hkv, tiles, n_used, *x.shape[3:])
        return x.index_select(2, pair_j)

    if plan.dense and tiles == 1 and not keep_for_backward:
        # decode / short prefill: the scores' left operand written directly -- the tile's rows for
        # every block, zero rows after them: the same values (and layout) as the general path
        q_rows = (q.to(torch.float32) * scaling).view(S, Hkv, rep, Tq, D).transpose(2, 3).reshape(S, Hkv, 1, rows, D)
        q_pairs = q_rows.new_zeros(S, Hkv, n_used, R, D)
        q_pairs[:, :, :, :rows] = q_rows
        q_tiles = None
    else:
        q_tiles = _heads_to_tiles(q.to(torch.float32) * scaling, plan, R)
        q_pairs = pairs_of_tiles(q_tiles)

    scores_tiles = matmul_tiles(flat(q_pairs), flat(pairs_of_blocks(k_blocks))).view(S, Hkv, n_pairs, R, B)
    scores = scores_tiles[:, :, :, :live]
    if additive:
        scores.add_(torch.where(plan.visible[:, None], 0.0, -1e9))
    else:
        scores.masked_fill_(plan.invisible[:, None], -math.inf)  # == torch.where(visible, scores, -inf)

    # running max after each block, per row: the same maximum() chain a block loop computes
    m_run = torch.cummax(_scatter_pairs(scores.amax(dim=-1), plan, -math.inf), dim=3).values
    m_ref = torch.where(m_run == -math.inf, 0.0, m_run)
    alpha = torch.exp(m_run[:, :, :, :-1] - m_ref[:, :, :, 1:])  # rescale of acc entering block j >= 1
    m_pairs = m_ref.view(S, Hkv, -1, live) if plan.dense else m_ref[:, :, pair_t, pair_j]
    p = rounded(scores.sub_(m_pairs[..., None]).exp_())  # == torch.exp(scores - m), in the scores' buffer
    # rows >= live of the tiles are padding whose PV rows are dropped; a GEMM row depends only on
    # its own row, so they keep the scores buffer's content instead of being zeroed
    p_tiles = scores_tiles
    pv = matmul_tiles(flat(p_tiles), flat(pairs_of_blocks(v_blocks)))
    pv = rounded(_scatter_pairs(pv.view(S, Hkv, n_pairs, R, D + 1)[:, :, :, :live], plan, 0.0))

    # online-softmax accumulation in block order: acc_j = acc_{j-1} * alpha_j + pv_j
    pv_j, alpha_j = pv.unbind(3), alpha[..., None].unbind(3)
    acc = pv_j[0]
    for j in range(1, n_used):
        acc = rounded(acc * alpha_j[j - 1] + pv_j[j])

    l = acc[..., D:]
    if additive:  # a plain softmax normalisation: nothing selects rows away
        out_tiles = acc[..., :D] / l
    else:
        has_keys = l > 0
        out_tiles = torch.where(has_keys, acc[..., :D] / torch.where(has_keys, l, 1.0), 0.0)
    out = _tiles_to_heads(out_tiles, plan).to(q.dtype)
    if not keep_for_backward:
        return out, None
    lse = m_run[:, :, :, -1] + torch.log(l[..., 0])  # -inf for rows without keys
    lse = torch.where(torch.isfinite(lse), lse, 0.0)
    # final probabilities of the computed pairs: p_j * exp(m_j - lse) (backward only; p is dead)
    probs = p.mul_(torch.exp(m_pairs - lse[:, :, pair_t])[..., None])
    state = dict(q_tiles=q_tiles, k_blocks=k_blocks, v_blocks=v_blocks, probs=probs, out_tiles=out_tiles)
    return out, state


def _torch_backward_operands(state, plan: AttentionPlan):
    """(q_tiles, k_blocks, v_blocks) of the torch backward: saved by the torch forward, or built from the
    native forward's q, k, v with the very functions the torch forward uses."""
    if "q_tiles" not in state:
        q, k, v = state["q"], state["k"], state["v"]
        k_blocks, v_blocks = _key_value_blocks(k, v, plan, NO_FAULT)
        q_tiles = _heads_to_tiles(q.to(torch.float32) * state["scaling"], plan, plan.R)
        state.update(q_tiles=q_tiles, k_blocks=k_blocks, v_blocks=v_blocks)
    return state["q_tiles"], state["k_blocks"], state["v_blocks"]


class _Attention(torch.autograd.Function):
    """Forward: the consistent kernel. Backward: the same (tile, block) pairs with plain bmm and
    index_add (gradients need not be batch-invariant)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scaling):
        out, state = _attention_forward(q, k, v, plan, scaling, keep_for_backward=True)
        ctx.state, ctx.plan, ctx.scaling, ctx.dtypes = state, plan, scaling, (q.dtype, k.dtype, v.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        st, plan = ctx.state, ctx.plan
        S, Hq, Tq, Hkv, Tk, rep, rows, tiles, live, n_blocks, n_used = plan.dims
        B = plan.B
        D = grad_out.shape[-1]
        pair_t, pair_j = plan.pair_t, plan.pair_j
        with _no_autocast(grad_out.device):
            do = _heads_to_tiles(grad_out, plan, live)
            delta = (do * st["out_tiles"]).sum(-1)  # [S, Hkv, tiles, live]
            probs = st["probs"]  # [S, Hkv, P, live, B]
            # the same bits, fused in C++ (after the native forward, whose state holds q, k, v)
            if "q" in st and (kernel := _route("attention_backward", grad_out.device, grad_out, plan)).run:
                grad_q, grad_k, grad_v = kernel.run(
                    do, delta, probs, st["q"], st["k"], st["v"], st["scaling"], plan.R, pair_t, pair_j,
                    plan.kv_invalid, n_blocks,
                )
                return _Attention.finish(ctx, grad_q, grad_k, grad_v)
            q_tiles, k_blocks, v_blocks = _torch_backward_operands(st, plan)
            do_p = do.index_select(2, pair_t)
            v_p = v_blocks.index_select(2, pair_j)[..., :D]
            # == probs * (dP - delta), in dP's buffer (IEEE products commute)
            grad_s = (do_p @ v_p.transpose(-1, -2)).sub_(delta[:, :, pair_t][..., None]).mul_(probs)
            grad_v = v_p.new_zeros(S, Hkv, n_blocks, B, D).index_add_(2, pair_j, probs.transpose(-1, -2) @ do_p)
            k_p = k_blocks.index_select(2, pair_j)  # [S, Hkv, P, D, B]
            grad_q = do.new_zeros(S, Hkv, tiles, live, D).index_add_(2, pair_t, grad_s @ k_p.transpose(-1, -2))
            q_p = q_tiles[:, :, :, :live].index_select(2, pair_t)
            grad_k = do.new_zeros(S, Hkv, n_blocks, B, D).index_add_(2, pair_j, grad_s.transpose(-1, -2) @ q_p)
        return _Attention.finish(ctx, grad_q, grad_k, grad_v)

    @staticmethod
    def finish(ctx, grad_q, grad_k, grad_v):
        """Tiles and blocks back to q, k, v's layouts and dtypes (invalid slots' values get no gradient)."""
        plan = ctx.plan
        S, Hq, Tq, Hkv, Tk, rep, rows, tiles, live, n_blocks, n_used = plan.dims
        D = grad_q.shape[-1]
        with _no_autocast(grad_q.device):
            grad_q = _tiles_to_heads(grad_q * ctx.scaling, plan)
            grad_k = grad_k.view(S, Hkv, n_blocks * plan.B, D)[:, :, :Tk]
            grad_v = grad_v.view(S, Hkv, n_blocks * plan.B, D)
            grad_v = torch.where(plan.kv_valid[:, None, :, None], grad_v, 0.0)[:, :, :Tk]
        ctx.state = None
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        return grad_q.to(q_dtype), grad_k.to(k_dtype), grad_v.to(v_dtype), None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor | None,
    kv_valid: torch.Tensor | None,
    scaling: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention as an online softmax over fixed KV blocks aligned at absolute positions.

    Args: ``q`` [S, Hq, Tq, D]; ``k``, ``v`` [S, Hkv, Tk, D] where the key index IS the absolute
    position; ``q_positions`` [S, Tq] absolute positions of the queries (-1 marks a padding row,
    whose output is 0); ``kv_valid`` [S, Tk] which key slots hold a real token; ``scaling`` the
    softmax scale; ``plan`` optionally :func:`attention_plan` of the same layout, built once and
    shared by all layers (then ``q_positions``/``kv_valid`` are not read). Key j is visible to a
    query at position p iff ``kv_valid[j] and j <= p``. Returns [S, Hq, Tq, D] in ``q``'s dtype.

    Invariant: a query row's result depends only on its own q, position and visible keys. Its
    scores and PV products are :func:`matmul_tiles` over tiles of :data:`ATTN_TILE_ROWS` rows (a
    single tile as short as :func:`tile_rows` allows)
    against one KV block of :data:`KV_BLOCK` keys (fp32); the running max, the rescale factors
    and the accumulator ``acc_j = acc_{j-1} * alpha_j + pv_j`` follow blocks 0, 1, 2, ... with the
    same fp32 ops for a whole sequence (training, prefill) and a single decode query. Invisible
    keys are selected away (score -inf, value 0), so garbage in masked slots never leaks, and a
    block with no visible key is an exact no-op for a row (``m`` unchanged, ``acc * 1 + 0``) --
    which is why a tile whose rows all precede a block may skip it. Backward (training) reuses
    the forward's (tile, block) pairs with plain ops.
    """
    if plan is None:
        plan = AttentionPlan(q_positions, kv_valid, q.shape[1], k.shape[1])
    S, Hq, Tq, Hkv, Tk, *_ = plan.dims
    if q.shape[:3] != (S, Hq, Tq) or k.shape[:3] != (S, Hkv, Tk) or v.shape[:3] != (S, Hkv, Tk):
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the plan")
    with _no_autocast(q.device):
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _Attention.apply(q, k, v, plan, scaling)
        return _attention_forward(q, k, v, plan, scaling)[0]


@dataclasses.dataclass(frozen=True)
class PagedKV:
    """Keys and values in a paged cache (vLLM's): slot ``t`` of sequence ``s`` is row
    ``(block_table[s, t // bs], :, t % bs)`` of ``key_cache`` / ``value_cache`` [blocks, Hkv, bs, D]."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [S, n_blocks] int

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as :func:`attention` takes them: [S, Hkv, n_blocks * bs, D], a copy."""
        S, n_blocks = self.block_table.shape
        _, hkv, bs, d = self.key_cache.shape
        table = self.block_table.long()
        return tuple(cache[table].permute(0, 2, 1, 3, 4).reshape(S, hkv, n_blocks * bs, d)
                     for cache in (self.key_cache, self.value_cache))

    def slot_rows(self) -> torch.Tensor:
        """[S, n_blocks * bs] int64: each slot's row as an element offset into either cache."""
        bs = self.key_cache.shape[2]
        offsets = torch.arange(bs, device=self.block_table.device) * self.key_cache.stride(2)
        rows = self.block_table.long()[:, :, None] * self.key_cache.stride(0) + offsets
        return rows.reshape(self.block_table.shape[0], -1)


def paged_attention(q: torch.Tensor, kv: PagedKV, plan: AttentionPlan, scaling: float) -> torch.Tensor:
    """:func:`attention` (inference) on keys and values in a paged cache: bitwise ``attention(q,
    *kv.gather(), ..., plan=plan)``. On CPU the native kernel reads the cache in place."""
    S, Hq, Tq, Hkv, Tk, *_ = plan.dims
    _, hkv, bs, _ = kv.key_cache.shape
    table = tuple(kv.block_table.shape)
    if tuple(q.shape[:3]) != (S, Hq, Tq) or table[0] != S or table[1] * bs != Tk or hkv != Hkv:
        raise ValueError(f"paged_attention: q {tuple(q.shape)}, cache {tuple(kv.key_cache.shape)}, block table "
                         f"{table} do not fit the plan's (S, Hq, Tq, Hkv, Tk) = {(S, Hq, Tq, Hkv, Tk)}")
    if (kernel := _route("paged_attention", q.device, q, kv)).run:
        tiles, live, n_used = plan.dims[7], plan.dims[8], plan.dims[10]
        with _no_autocast(q.device):
            return kernel.run(q, kv.key_cache, kv.value_cache, scaling, plan.R, plan.B, tiles, live, n_used,
                              plan.pair_t, plan.pair_j, plan.invisible, plan.kv_invalid, K_CHUNK, False,
                              kv.slot_rows())[0]
    keys, values = kv.gather()
    return attention(q, keys, values, None, None, scaling, plan)


# ----------------------------------------------------------------------------------------------
# MoE
# ----------------------------------------------------------------------------------------------


def moe_route(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax over experts, then the top-k with ties broken towards the lower expert index.

    Returns ``(weights fp32 [T, k], experts long [T, k])``, best first. Invariant: per-row fp32
    math (max, :func:`fixed_sum`, exp, divide) and a STABLE descending sort, so the selection and
    weights of a token never depend on the other tokens or on ``torch.topk``'s tie order.
    """
    x = router_logits.to(torch.float32)
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    probs = e / fixed_sum(e)
    if _SWITCHES.fault.router_ties_to_higher:  # a planted fault (diagnosis only): the tie order reversed
        values, indices = torch.sort(probs.flip(-1), dim=-1, descending=True, stable=True)
        indices = (probs.shape[-1] - 1) - indices
    else:
        values, indices = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, experts = values[..., :top_k], indices[..., :top_k]
    if norm_topk_prob:
        weights = weights / fixed_sum(weights)
    return weights, experts


def moe_experts(hidden, top_k_index, gate_up, down, *, experts=None, k_parts=1, gather=None, packs=None):
    """Every (token, slot) pair through its expert: [tokens, top_k, hidden] in slot order.

    Pairs are grouped by expert with a stable sort (token order inside an expert), each expert runs
    ``down(silu(gate) * up)`` on its rows with :func:`linear`, and the rows go back to their slots.
    ``gate_up[e]`` is [2 * inter, hidden] (gate rows first), ``down[e]`` is [hidden, inter]. Both
    engines call this one function, so the expert arithmetic cannot drift between them. Sharded:

    * ``experts`` (expert parallelism): the global ids of the experts ``gate_up``/``down`` hold, in
      their order; pairs routed to other experts get zero rows (:func:`moe_select` takes each slot
      from the rank that holds its expert).
    * ``k_parts`` > 1 (expert tensor parallelism): every expert's intermediate dim is split in
      ``k_parts`` shards and these weights hold one (gate rows then up rows of the shard; the down
      projection's columns): the down projection is the shard's fp32 subtree (:func:`linear`),
      ``gather(partials)`` returns every shard's, in shard order, and :func:`tree_combine` plus
      :func:`linear_epilogue` finish it -- bitwise the unsharded experts.

    ``packs``: :func:`pack_experts` of these weights (an inference engine's, built once per weight load): the
    same bits.
    """
    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    held = list(range(len(gate_up))) if experts is None else [int(e) for e in experts]
    if len(held) != len(gate_up):
        raise ValueError(f"moe_experts: {len(gate_up)} expert weights for expert ids {held}")
    if k_parts > 1 and gather is None:
        raise ValueError("moe_experts: k_parts > 1 needs gather (the shards' partials in shard order)")
    if packs is not None and not (len(packs) == 2 and len(packs[0]) == len(packs[1]) == len(gate_up)):
        raise ValueError(f"moe_experts: packs must be (gate_up packs, down packs) for {len(gate_up)} experts")
    if (kernel := _route("moe_experts", hidden.device, hidden, gate_up, down, k_parts, experts, packs)).run:
        gate_up_list, down_list = list(gate_up), list(down)
        leaves = (local_leaves(hidden.shape[-1], 1), local_leaves(down_list[0].shape[-1], 1))
        if kernel.path == "dot":
            kernel_packs = [[p.tensors for p in part] for part in packs]
        else:
            kernel_packs = [[p.tensors[0] for p in part] for part in packs] if packs is not None else [[], []]
        per_slot = kernel.run(hidden, top_k_index, gate_up_list, down_list, *kernel_packs, K_CHUNK, *leaves)
        return per_slot.view(tokens, top_k, hidden.shape[-1])
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=max(held, default=-1) + 1).tolist()
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    pair_ids, outputs = [], []
    out_dtype = torch.float32 if k_parts > 1 else hidden.dtype
    for local, expert in enumerate(held):
        count = counts[expert]
        if count == 0:
            continue
        pairs = order[starts[expert] : starts[expert] + count]
        x = hidden[pairs // top_k]
        gate_up_pack, down_pack = (None, None) if packs is None else (packs[0][local], packs[1][local])
        gate, up = linear(x, gate_up[local], pack=gate_up_pack).chunk(2, dim=-1)
        outputs.append(linear(silu_mul(gate, up), down[local], None, out_dtype, k_parts=k_parts, pack=down_pack))
        pair_ids.append(pairs)
    width = hidden.shape[-1]
    grouped = torch.cat(outputs) if outputs else hidden.new_zeros(0, width, dtype=out_dtype)
    if k_parts > 1:  # every rank ran every pair: the same rows in the same order
        grouped = linear_epilogue(tree_combine(gather(grouped)), None, hidden.dtype)
    per_slot = hidden.new_zeros(tokens * top_k, width)
    if outputs:
        per_slot[torch.cat(pair_ids)] = grouped
    return per_slot.view(tokens, top_k, width)


def moe_select(per_slot_by_rank: list[torch.Tensor], owner: torch.Tensor) -> torch.Tensor:
    """Expert parallelism: slot (t, s) taken from rank ``owner[t, s]``'s :func:`moe_experts` rows.

    A selection, no arithmetic: the result is bitwise the unsharded experts' per-slot rows whatever
    rank holds which expert, and :func:`moe_combine` then adds them in slot order.
    """
    stacked = torch.stack(per_slot_by_rank)  # [ranks, T, k, H]
    index = owner.long()[None, :, :, None].expand(1, *stacked.shape[1:])
    return stacked.gather(0, index)[0]


def moe_combine(expert_outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_k weights[:, k] * expert_outputs[:, k]`` in fp32, added in slot order k = 0, 1, ...

    ``expert_outputs`` [T, k, H] holds each token's output of its k-th selected expert.
    Invariant: a token's combination is a fixed left-to-right chain of elementwise fp32 ops,
    independent of how tokens were grouped per expert. Returns fp32 [T, H].
    """
    y = expert_outputs.to(torch.float32) * weights.to(torch.float32)[..., None]
    out = y[:, 0]
    for slot in range(1, y.shape[1]):
        out = out + y[:, slot]
    return out


# ----------------------------------------------------------------------------------------------
# Log-probs
# ----------------------------------------------------------------------------------------------


def _shifted_and_lse(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.to(torch.float32) / temperature
    shifted = x - x.amax(dim=-1, keepdim=True)
    return shifted, torch.log(fixed_sum(torch.exp(shifted)))


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 full-vocabulary ``log_softmax(logits / temperature)`` over the last dim.

    Invariant: per row, fp32 divide, exact max, fp32 exp, :func:`fixed_sum` over the whole
    vocabulary and fp32 log -- the same bits for a row whatever the batch around it. Entry
    ``[..., t]`` is bitwise :func:`token_log_probs` at label ``t`` (the same elementwise ops), so
    a sampler reading its distribution and a trainer scoring the token agree.
    """
    shifted, lse = _shifted_and_lse(logits, temperature)
    return shifted - lse


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """:func:`log_softmax` gathered at ``labels``: ``logits`` [..., V], ``labels`` [...] -> fp32 [...].

    Invariant: as :func:`log_softmax` (fp32, fixed-order full-vocabulary sum), without
    materialising the [..., V] result.
    """
    shifted, lse = _shifted_and_lse(logits, temperature)
    picked = torch.gather(shifted, -1, labels.long().unsqueeze(-1))
    return (picked - lse).squeeze(-1)
