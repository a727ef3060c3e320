"""What the ops' bits rest on besides the project's own code: the vendor kernels, named, probed and keyed.

On x86 torch's fp32 GEMM (``torch.bmm``, ``@``) is MKL's sgemm and its fp32 ``exp``/``log``/``sqrt``/``sin``/``cos``
are MKL VML's. MKL picks its kernels by CPU vendor and instruction set, so where an op's torch code calls them
its bits are a *premise* (:data:`VENDOR_KERNELS`), not an order the project fixes; the project's own order
(correctly rounded ``+ - * /``, the fixed tree, the native library's fma chain) is the same on every x86 CPU.
:func:`blas_fingerprint` names the vendor kernels of this process: their outputs on fixed inputs, hashed;
:func:`key` (torch's capability and the fingerprint) is what stored bits that rest on them are keyed by.
:data:`PREMISES` states, one line each, the facts about MKL that the tests' twins and the torch-code
comparisons assume; a test whose premise does not hold on a CPU skips naming it and the key. Pure torch.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re

import torch

# the kernels an op's torch code may call whose order the project does not fix, by name (what ops.bits_rest_on
# returns): MKL's on x86, probed by blas_fingerprint; ATen's own vectorised ones follow torch's capability
VENDOR_KERNELS = {
    "mkl_sgemm": "torch.bmm / @ in fp32 (MKL's sgemm)",
    "vml_exp": "torch.exp in fp32 (MKL VML)",
    "vml_log": "torch.log in fp32 (MKL VML)",
    "vml_sqrt": "torch.sqrt in fp32 (MKL VML; not the correctly rounded square root)",
    "vml_sincos": "torch.sin / torch.cos in fp32 (MKL VML)",
    "aten_pow": "a float ** an fp32 tensor (ATen's vectorised pow, by torch's CPU capability; not probed)",
}

# facts about MKL that a test assumes, by name: each holds on the CPUs the goldens were written on, none is
# promised by MKL; a test resting on one looks for it on the CPU it runs on and skips naming it where it fails
PREMISES = {
    "mkl_sgemm_chain": "MKL's sgemm computes every product the linear's torch code makes (tiles of 4..64 rows, "
                       "K chunks and their tails, N >= FMA_CHAIN_MIN_N) as one fma chain over k from 0",
    "mkl_narrow_kernel": "below FMA_CHAIN_MIN_N columns MKL's sgemm runs a kernel other than the fma chain",
    "mkl_long_k": "above K_CHUNK MKL's sgemm does not compute an entry as one fma chain over k",
    "mkl_short_tiles": "MKL's sgemm gives rows in a tile of 1 or 2 rows other bits than in a 64-row tile",
    "blas_threshold": "below BLAS_MIN_WORK multiply-adds torch's bmm runs its own loop, other row bits than MKL's",
    "held_key": "this CPU's MKL sgemm and VML (its key) compute the bits of a goldens file of the index",
}

# variables that make MKL, oneDNN or torch pick other kernels, so other bits for the vendor ones
KERNEL_ENVIRONMENT = ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")

# (G, R, K, N) of the probe's bmm: the linear's tiles (4 and 64 rows, a full K chunk, a leaf's 19-wide tail,
# N 12 / 20 / 24 and a narrow 4) and attention's scores and PV (K = head dim, N = KV_BLOCK; K = KV_BLOCK, N =
# head dim + 1); MM_SHAPES (M, K, N): unsplit 2-D products, as the linear's backward makes
GEMM_SHAPES = ((2, 4, 19, 20), (2, 4, 128, 20), (2, 64, 128, 24), (2, 8, 64, 12), (2, 64, 8, 4),
               (2, 32, 16, 64), (2, 32, 64, 17), (2, 16, 100, 33), (1, 2, 64, 64), (1, 1, 128, 40))
MM_SHAPES = ((37, 300, 40), (96, 111, 64))


def _inputs(n: int, seed: int, scale: float = 2.0**-20) -> torch.Tensor:
    """``n`` fp32 values ``k * scale``, ``k`` uniform integers in [-2^23, 2^23): the same bits on every CPU
    (``torch.randn``'s vectorised Box-Muller follows torch's capability, so it would move the fingerprint)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 23), 1 << 23, (n,), generator=g, dtype=torch.int64).to(torch.float32) * scale


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.int32).numpy().tobytes())
    return h.hexdigest()[:6]


def _digests() -> dict[str, str]:
    """Each vendor kernel's digest on fixed inputs: ``gemm`` (sgemm at the torch code's shapes) and VML's
    ``exp``, ``log``, ``sqrt``, ``sincos``; on the calling thread count."""
    pool = _inputs(1 << 15, 54)  # every operand a slice of it

    def take(start: int, *shape: int) -> torch.Tensor:
        n = math.prod(shape)
        start %= pool.numel() - n
        return pool[start : start + n].view(*shape)

    gemm = [torch.bmm(take(7919 * i, g, r, k), take(104729 * i + 13, g, k, n))
            for i, (g, r, k, n) in enumerate(GEMM_SHAPES)]
    gemm += [take(31 * i, m, k) @ take(977 * i + 5, k, n) for i, (m, k, n) in enumerate(MM_SHAPES)]
    x = pool[: 1 << 14]
    return {
        "gemm": _digest(*gemm),
        "exp": _digest(torch.exp(x * 11.0)),
        "log": _digest(torch.log(x.abs() * 1e3 + 2.0**-20)),
        "sqrt": _digest(torch.sqrt(x.abs() * 1e3)),
        "sincos": _digest(torch.cos(x * 500.0), torch.sin(x * 500.0)),
    }


@functools.lru_cache(maxsize=1)
def _probes_one_thread() -> tuple[tuple[str, str], ...]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tuple(_digests().items())
    finally:
        torch.set_num_threads(previous)


def probes() -> dict[str, str]:
    """The vendor kernels' digests on fixed inputs (``gemm``: sgemm at the torch code's shapes; VML's ``exp``,
    ``log``, ``sqrt``, ``sincos``), computed once per process on one intra-op thread: they name the kernels,
    not a split over threads, and one thread never waits on an OpenMP team whose cores are busy."""
    return dict(_probes_one_thread())


def blas_fingerprint() -> str:
    """``g<gemm>v<vml>``: the order this process's sgemm and VML kernels compute in, 6 hex digits each."""
    digests = probes()
    vml = hashlib.sha256("".join(digests[name] for name in ("exp", "log", "sqrt", "sincos")).encode()).hexdigest()
    return f"g{digests['gemm']}v{vml[:6]}"


def key() -> str:
    """What bits resting on the vendor kernels are keyed by: torch's CPU capability and :func:`blas_fingerprint`."""
    return f"{torch.backends.cpu.get_cpu_capability()}_{blas_fingerprint()}"


def sqrt_is_ieee() -> bool:
    """Whether torch's fp32 sqrt is the correctly rounded one here (float64's, rounded once: exact for sqrt)."""
    x = _inputs(1 << 12, 500).abs() * 100
    return torch.equal(torch.sqrt(x), torch.sqrt(x.double()).float())


CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")  # the flags the kernels and their premises read


def cpu_info() -> dict:
    """``{"model", "cores", "flags": {flag: bool}}`` from /proc/cpuinfo (model "unknown", flags all False where
    it cannot be read: a report, never a decision)."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "flags": {flag: flag in flags for flag in CPU_FLAGS}}


def mkl_version() -> str:
    """MKL's and oneDNN's versions as torch's build reports them ("no MKL" where torch has none)."""
    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([\w.\-]+ ?[^\n]*?)(?: for|\n)", config)
    dnn = re.search(r"MKL-DNN (v[\d.]+)", config)
    return (f"MKL {mkl.group(1).strip()}" if mkl else "no MKL") + (f", oneDNN {dnn.group(1)}" if dnn else "")
