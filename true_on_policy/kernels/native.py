"""The C++ fast path of the consistent kernels on CPU (``csrc/*.cpp``: one library), built once per environment.

:mod:`true_on_policy.kernels.ops` calls it for CPU tensors when it is loaded; it computes the very
bits of the ops' torch code (``tests/unit/test_native_ops.py`` holds them ``torch.equal``) with one C++
call where the torch code dispatches 10-50 small ops. Its attention (and a decode step's linears)
is fused: the products are the project's fma chains, which MKL's GEMM computes on torch's BLAS path on the
CPUs measured -- taken only where :func:`fma_chain_lib`'s load-time check found MKL computing them on this
CPU. The check covers some shapes, not every one: where MKL differs elsewhere the native path keeps the
project's order and the torch code MKL's (premise ``mkl_sgemm_chain``, :mod:`.premises`). bf16 linears compute
those chains reading bf16, on AVX512-BF16's dot-product instruction, where :func:`bf16_dot_lib` has
checked it. ``make install`` builds the library (``python -m true_on_policy build-native``);
otherwise the first process that needs it builds it
(once per environment: it lives under ``sys.prefix``, keyed by the sources' hash, the flags
and torch's version; ``-march=native``: for the machine it is built on). Its loops run on torch's
intra-op threads (OpenMP), each output written by one thread in a fixed order. If it cannot be built the
ops run their torch code -- the same bits, slower -- and say so once on stderr. Which op calls which
of its functions, and when, is :data:`true_on_policy.kernels.ops.ROUTES`; ``ops.switched(native=False)``
forces the torch code (tests compare the two paths). The layout constants the ops' dispatch reads come
from the library (:func:`constants`), never copied here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).parent / "csrc"
# one extension, one module (fixed_order.cpp's): each op family's source registers its own functions there
SOURCES = tuple(CSRC / name for name in ("fixed_order.cpp", "norms.cpp", "activation.cpp", "linear.cpp", "moe.cpp",
                                         "attention.cpp", "gated_delta.cpp", "gated_delta_layer.cpp"))
HEADERS = tuple(CSRC / name for name in ("library.h", "common.h", "fma_chain.h", "bf16_dot.h", "fixed_tree.h",
                                         "delta_step.h"))
# no FMA contraction, no fast-math: the C++ must round exactly where the torch code rounds.
# -fopenmp: without it ATen's header-only at::parallel_for compiles to a serial loop; the library then
# links libgomp.so.1, which resolves to the copy torch has already loaded (one thread pool)
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
# The sources compile as one translation unit: each parses torch's extension header, most of its compile time, and
# one unit parses it once (benchmarks/bench_native_build.py). The flags above fix every rounding, so which
# functions the compiler inlines across sources changes no bit.
ONE_UNIT = "one_unit.cpp"

_lib: ModuleType | None = None
_tried = False
_constants: dict[str, int] | None = None


def build_directory() -> Path:
    """Where this environment's library lives: one folder per (sources and headers, flags, torch version)."""
    code = _one_unit().encode() + b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    digest = hashlib.sha256(code + " ".join(CFLAGS + LDFLAGS).encode()).hexdigest()[:12]
    name = f"fixed_order-{digest}-torch{torch.__version__.replace('+', '_')}"
    for root in (Path(sys.prefix) / "var" / "true_on_policy", Path.home() / ".cache" / "true_on_policy" / "native"):
        try:
            (root / name).mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(root / name, os.W_OK):
            return root / name
    raise OSError(f"no writable build directory for the native kernels under {sys.prefix} or ~/.cache")


def _one_unit() -> str:
    """The translation unit that includes every source, in :data:`SOURCES`' order."""
    return "".join(f'#include "{path.name}"\n' for path in SOURCES)


def staged_sources(directory: Path) -> list[Path]:
    """The sources (and headers) copied into ``directory``, whose name already holds their hash, beside the one
    unit that includes them all (:data:`ONE_UNIT`, the one source the build compiles): the build (ninja's rules name
    each source by path) is then the same for every copy of this package on the environment -- an editable
    checkout, a worktree, an installed wheel -- instead of each rebuilding the shared library the other just
    built. Written atomically (concurrent builders)."""
    staged = directory / "src"
    staged.mkdir(exist_ok=True)
    files = {path.name: path.read_bytes() for path in SOURCES + HEADERS} | {ONE_UNIT: _one_unit().encode()}
    for name, code in files.items():
        target = staged / name
        if not target.exists() or target.read_bytes() != code:
            partial = staged / f".{name}.{os.getpid()}"
            partial.write_bytes(code)
            os.replace(partial, target)
    return [staged / ONE_UNIT]


# torch's own build lock in a build directory: a file (its FileBaton) that a killed builder leaves behind, on
# which every later load then waits forever
TORCH_BUILD_LOCK = "lock"


@contextlib.contextmanager
def one_builder(directory: Path) -> Iterator[None]:
    """One builder or loader at a time in ``directory``, by an OS lock the kernel drops when its holder dies.
    Holding it, no other process of ours is inside torch's build, so a torch build lock found there was left by
    a builder that died: it is removed, and the load goes on instead of hanging."""
    with open(directory / "build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / TORCH_BUILD_LOCK).unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build() -> ModuleType:
    """Build (or load the already built) library; raises if the compiler fails."""
    from torch.utils.cpp_extension import load

    directory = build_directory()
    with one_builder(directory):
        return load(
            name=f"true_on_policy_fixed_order_{directory.name.split('-')[1]}",
            sources=[str(path) for path in staged_sources(directory)],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(directory),
            verbose=False,
        )


def exp_is_torchs(library: ModuleType) -> bool:
    """Whether the library's exp (MKL VML's, called directly: the fused attention's exps are many small
    runs) computes ``torch.exp``'s fp32 bits on this machine -- specials, denormal results and every
    vector tail included."""
    gen = torch.Generator().manual_seed(2468)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 88.72, 88.73, -87.33, -103.97, -104.0, -150.0])
    x = torch.cat([specials, torch.randn(4000, generator=gen) * 20, -torch.rand(4000, generator=gen) * 110])
    reference = torch.exp(x).view(torch.int32)  # bits: NaN payloads too
    return all(torch.equal(library.exp_fp32(x[a : a + n]).view(torch.int32), reference[a : a + n])
               for a, n in ((0, x.numel()), (0, 11), (5, 1), (3, 17), (100, 1000), (7, 2049), (11, 64)))


def lib() -> ModuleType | None:
    """The loaded library, or None (the build failed: said once on stderr)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        try:
            _lib = build()
            # VML's exp where it computes torch's bits (else at::exp: the same bits, one dispatch per run)
            if _lib.use_vml_exp(True) and not exp_is_torchs(_lib):
                _lib.use_vml_exp(False)
        except Exception as error:  # noqa: BLE001 -- any build failure leaves the torch code, said loudly
            warnings.warn(
                f"true_on_policy: the native consistent kernels could not be built ({type(error).__name__}: "
                f"{str(error).strip().splitlines()[-1] if str(error).strip() else ''}); the ops run their torch "
                "code instead (the same bits, slower). `python -m true_on_policy build-native` shows the error.",
                RuntimeWarning,
                stacklevel=2,
            )
    return _lib


def constants() -> dict[str, int]:
    """The library's layout constants by name (``dot_group``: the dot path's columns per group), read from it
    once; the library must be loaded."""
    global _constants
    if _constants is None:
        _constants = dict(lib().constants())
    return _constants


# the project's fma chain (each entry over k from 0: what the fused attention and the linears write out) is what
# MKL's fp32 GEMM computes on torch's BLAS path (>= 4 rows, R * K * N >= 400) on the CPUs measured, for N >= 12
# output columns only (premises mkl_sgemm_chain and mkl_narrow_kernel): narrower products are padded to it
FMA_CHAIN_MIN_N = 12
# (rows, K, N) the check below covers: the attention's products (scores: K = head dim, N = KV_BLOCK;
# PV: K = KV_BLOCK, N = head dim + 1), the narrowest N the chain is claimed for and a linear's full tile
# (ops.TILE_ROWS rows, one K_CHUNK)
CHAIN_CHECK_SHAPES = ((8, 16, 64), (4, 64, 17), (32, 128, 64), (8, 64, 129), (5, 100, 64), (8, 64, FMA_CHAIN_MIN_N),
                      (64, 128, 80))
_fma_chain: bool | None = None


def gemm_is_fma_chain(library: ModuleType) -> bool:
    """Whether ``torch.bmm`` computes the library's fma chains bitwise on this machine (MKL picks its
    kernels by CPU)."""
    gen = torch.Generator().manual_seed(1234)
    for rows, k, n in CHAIN_CHECK_SHAPES:
        a, b = torch.randn(3, rows, k, generator=gen), torch.randn(3, k, n, generator=gen)
        reference = torch.bmm(a, b)
        if not all(torch.equal(library.chain_matmul(a[g], b[g]), reference[g]) for g in range(3)):
            return False
    return True


def fma_chain_lib(width: int) -> ModuleType | None:
    """The library if its fma-chain products compute the torch code's bits for products ``width``
    columns wide (attention's PV: head dim + 1; a linear: its output features), else None.

    That holds where MKL runs the fma-chain kernel: ``width`` >= :data:`FMA_CHAIN_MIN_N`, on a CPU
    whose MKL was checked once per process (:func:`gemm_is_fma_chain`; a mismatch is said on stderr
    and leaves the torch code). The check covers :data:`CHAIN_CHECK_SHAPES`: a CPU may pass it and differ at
    another shape, where the route still computes the project's order -- training and rollout alike, as both
    take the route by this rule.
    """
    global _fma_chain
    library = lib()
    if library is None or width < FMA_CHAIN_MIN_N:
        return None
    if _fma_chain is None:
        _fma_chain = gemm_is_fma_chain(library)
        if not _fma_chain:
            warnings.warn(
                "true_on_policy: this CPU's MKL does not compute fp32 GEMM entries as an fma chain over k; "
                "the consistent attention and small linears run their torch code (the same bits, slower)",
                RuntimeWarning,
                stacklevel=2,
            )
    return library if _fma_chain else None


# (rows, K, N, leaves) the dot path's check covers: decode and prefill heights, several k chunks per
# leaf, a chunk's tail, a tree of leaves, a partial 16-column panel
DOT_CHECK_SHAPES = ((1, 256, 40, 1), (5, 384, 12, 1), (9, 96, 33, 4), (70, 1024, 24, 8), (3, 200, 16, 2))
_bf16_dot: bool | None = None


def dot_is_fma_chain(library: ModuleType) -> bool:
    """Whether the library's bf16 dot path (vdpbf16ps) computes, on this CPU, the bits of its fp32 path on
    the widened operands (zeros of both signs included)."""
    gen = torch.Generator().manual_seed(4321)
    for rows, k, n, leaves in DOT_CHECK_SHAPES:
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
        x[0, :3] = torch.tensor([0.0, -0.0, 0.0])
        w[:, 1::7] = -0.0
        x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
        dot = library.linear_dot(x, w, None, torch.float32, 128, leaves, None)
        widened = library.linear_tiles(x.float(), w.float(), None, torch.float32, 64, 128, leaves)
        if not torch.equal(dot, widened):
            return False
    return True


def bf16_dot_lib() -> ModuleType | None:
    """The library if its linear's dot path -- bf16 operands read as bf16 by AVX512-BF16's vdpbf16ps --
    computes the torch code's bits on this CPU, else None.

    Needs the fma chain (:func:`fma_chain_lib`), a library built with AVX512-BF16, and one check per
    process (:func:`dot_is_fma_chain`; a mismatch is said on stderr and leaves the fp32 path).
    """
    global _bf16_dot
    library = fma_chain_lib(FMA_CHAIN_MIN_N)
    if library is None or not library.bf16_dot_built():
        return None
    if _bf16_dot is None:
        _bf16_dot = dot_is_fma_chain(library)
        if not _bf16_dot:
            warnings.warn(
                "true_on_policy: this CPU's vdpbf16ps does not compute the fma chain of the widened operands; "
                "bf16 linears widen their operands to fp32 (the same bits, slower)",
                RuntimeWarning,
                stacklevel=2,
            )
    return library if _bf16_dot else None
