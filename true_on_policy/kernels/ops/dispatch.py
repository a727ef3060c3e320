"""The ops' one switch and their one dispatch: which implementation computes an op.

:class:`Switches` (the flag models read, the native kernels, :class:`Fault` switches for diagnosis) is set
by :func:`set_switches` or :func:`switched`; the ops always compute the consistent way, except under fault
switches. :data:`ROUTES` (read by :func:`_route` alone) says which implementation computes an op: on CPU
some ops call :mod:`..native` (C++), the same bits; the ops' torch code stays the specification. What an op's
bits rest on besides the project's order -- vendor kernels (:mod:`..premises`) -- is recorded per route
(:attr:`Route.rests_on`) and for the torch code (:data:`SPEC_RESTS_ON`); :func:`bits_rest_on` reads both.

The op families, each a module of this package: :mod:`.tiling` (tiles, K chunks), :mod:`.elementwise`
(``fixed_sum``, silu, sigmoid), :mod:`.norms` (RMSNorm), :mod:`.linear_tree` (the linear and its weight
packs), :mod:`.rope`, :mod:`.block_attention` (attention, paged attention), :mod:`.log_probs`; the MoE ops
live in :mod:`true_on_policy.kernels.moe`, :func:`gated_delta.delta_rule` in :mod:`..gated_delta`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import NamedTuple

import torch

from true_on_policy.kernels import native
from true_on_policy.kernels.ops import tiling
from true_on_policy.kernels.scope import KERNEL_DTYPES

DTYPES = {name: getattr(torch, name) for name in KERNEL_DTYPES}  # the dtypes the kernels compute in, by name

# ----------------------------------------------------------------------------------------------
# The one switch
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fault:
    """Switches that break a rule on purpose, for :mod:`true_on_policy.diagnose`'s fault injection only.

    They act on the real kernels (attention's torch code, :func:`moe.moe_route`; never on copies, which would
    drift from them), forward only; all off (the default) leaves every op and every bit unchanged.
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

    ``consistent``: models patched by :mod:`..model` run on these ops (:func:`enabled`). ``native``: CPU ops run
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
    """Whether models patched by :mod:`..model` run on these ops (``switches().consistent``)."""
    return _SWITCHES.consistent


def consistent(value: bool = True) -> contextlib.AbstractContextManager[Switches]:
    """``switched(consistent=value)``: the engines' scope of the flag."""
    return switched(consistent=value)


# ----------------------------------------------------------------------------------------------
# Dispatch: the one table of which implementation computes an op
# ----------------------------------------------------------------------------------------------


class Route(NamedTuple):
    """A C++ CPU kernel of an op: ``path`` (its name among the op's kernels), ``entry`` (the library's function)
    and ``premise``: given the op's arguments, the library (:mod:`..native`) where ``entry`` computes the
    specification's bits for them, else a false value -- a library check, a width, dtypes, autograd, faults.

    ``rests_on``: the vendor kernels (:data:`premises.VENDOR_KERNELS`) its bits rest on; empty: the project's
    order alone. A route that computes in the project's order what the torch code leaves to MKL (its fma chain
    for sgemm) equals the torch code where MKL computes that order: the load-time check ``fma_chain`` of its
    ``probes`` (:data:`PROBES`: the once-per-process checks ``premise`` reads) is where the route takes it.
    """

    path: str
    entry: str
    premise: Callable[..., ModuleType | None]
    rests_on: tuple[str, ...]
    probes: tuple[str, ...] = ("native",)


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


def _fits_linear_chain(x_dtype, weight, k_per_leaf):  # the fma chain, where MKL was found computing it for N columns
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
    if (live < tiling.SHORT_TILE_ROWS[0] or live * D * plan.B < tiling.BLAS_MIN_WORK
            or max(D, plan.B, live) > tiling.K_CHUNK):
        return None
    return native.fma_chain_lib(D)


def _moe_in_one_call(hidden, gate_up, down, k_parts, experts) -> bool:
    """:func:`moe.moe_experts` as one native call: inference, unsharded, hidden and weights of one dtype."""
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


def _fits_gated_delta_net_slots(mixed_qkv, z, a, b, conv_cache, state_cache, conv_weight, norm_weight):
    """One dtype (fp32 or bf16) for the activations, conv state and weight; rows of unit inner stride; fp32 states."""
    dtype = mixed_qkv.dtype
    if dtype not in (torch.float32, torch.bfloat16) or any(x.dtype != dtype for x in (z, a, b, conv_cache, conv_weight)):
        return None
    if state_cache.dtype != torch.float32 or state_cache.dim() != 4 or state_cache.stride()[1:] != (
            state_cache.shape[2] * state_cache.shape[3], state_cache.shape[3], 1) \
            or norm_weight.dtype not in (torch.float32, torch.bfloat16) \
            or any(x.dim() != 2 or x.stride(1) != 1 for x in (mixed_qkv, z, a, b)):
        return None
    return _inference(mixed_qkv, z, a, b, conv_weight, norm_weight) and native.lib()


def _fits_delta_rule_backward(q):  # the backward itself: no graph to keep, no CPU premise
    return native.lib()


# the once-per-process checks a route's premise reads, by name: the library built, MKL's sgemm found computing
# the library's fma chain (native.gemm_is_fma_chain), the bf16 dot product found computing it
PROBES: dict[str, Callable[[], bool]] = {
    "native": lambda: native.lib() is not None,
    "fma_chain": lambda: native.fma_chain_lib(native.FMA_CHAIN_MIN_N) is not None,
    "bf16_dot": lambda: native.bf16_dot_lib() is not None,
}
_CHAIN, _DOT = ("native", "fma_chain"), ("native", "fma_chain", "bf16_dot")

# op -> its C++ CPU kernels, tried in order: the first whose premise holds runs. Where none holds, on any other
# device (whose kernels are the torch ops themselves) and with ``switches().native`` off, the op's torch code --
# the specification, which every C++ kernel is held torch.equal to -- runs. A premise takes the op's arguments.
ROUTES: dict[str, tuple[Route, ...]] = {
    "fixed_sum": (Route("native", "fixed_sum", _fits_fixed_sum, ()),),
    "rms_norm": (Route("native", "rms_norm", _fits_rms_norm, ("vml_sqrt",)),),  # torch's sqrt, called
    "silu_mul": (Route("native", "silu_mul", _fits_silu_mul, ("vml_exp",)),),  # torch's exp, called
    "linear": (Route("dot", "linear_dot", _fits_linear_dot, (), _DOT),
               Route("chain", "linear_chain", _fits_linear_chain, (), _CHAIN),
               Route("tiles", "linear_tiles", _fits_linear_tiles, ("mkl_sgemm",))),  # the torch code's aten calls
    "attention": (Route("native", "attention", _fits_attention, ("vml_exp", "vml_log"), _CHAIN),),
    "attention_backward": (Route("native", "attention_backward", _fits_attention_backward, (), _CHAIN),),
    "paged_attention": (Route("native", "attention", _fits_paged_attention, ("vml_exp", "vml_log"), _CHAIN),),
    "moe_experts": (Route("dot", "moe_experts", _fits_moe_dot, ("vml_exp",), _DOT),
                    Route("chain", "moe_experts_chain", _fits_moe_chain, ("vml_exp",), _CHAIN)),
    "delta_rule": (Route("native", "delta_rule", _fits_delta_rule, ()),),  # gated_delta.delta_rule's core
    # gated_delta.gated_delta_net_slots: a serving engine's whole GDN layer step in one call
    "gated_delta_net_slots": (Route("native", "gated_delta_net_slots", _fits_gated_delta_net_slots,
                                    ("vml_exp", "vml_log", "vml_sqrt")),),
    # gated_delta.CheckpointedDeltaRule's backward walk (close to autograd's, not bitwise)
    "delta_rule_backward": (Route("native", "delta_rule_backward", _fits_delta_rule_backward, ()),),
}

# op -> the vendor kernels (premises.VENDOR_KERNELS) its torch code, the specification, rests on; empty: the
# project's order alone (correctly rounded elementwise arithmetic, fixed trees and chains)
SPEC_RESTS_ON: dict[str, tuple[str, ...]] = {
    "fixed_sum": (), "tree_combine": (), "linear_epilogue": (), "apply_rope": (), "moe_combine": (), "delta_rule": (),
    "matmul_tiles": ("mkl_sgemm",), "matmul_tree": ("mkl_sgemm",), "linear": ("mkl_sgemm",),
    "attention_backward": ("mkl_sgemm",), "delta_rule_backward": ("mkl_sgemm",),
    "rms_norm": ("vml_sqrt",), "silu": ("vml_exp",), "silu_mul": ("vml_exp",), "sigmoid": ("vml_exp",),
    "sigmoid_gate": ("vml_exp",), "moe_route": ("vml_exp",), "rope_table": ("vml_sincos", "aten_pow"),
    "log_softmax": ("vml_exp", "vml_log"), "token_log_probs": ("vml_exp", "vml_log"),
    "attention": ("mkl_sgemm", "vml_exp", "vml_log"), "paged_attention": ("mkl_sgemm", "vml_exp", "vml_log"),
    "moe_experts": ("mkl_sgemm", "vml_exp"), "gated_delta_net_slots": ("vml_exp", "vml_log", "vml_sqrt"),
}


def bits_rest_on(op: str, path: str = "torch") -> tuple[str, ...]:
    """The vendor kernels ``op``'s bits rest on where ``path`` computes it ("torch": the specification, else a
    route of :data:`ROUTES`); empty: the project's order alone."""
    if op not in SPEC_RESTS_ON:
        raise KeyError(f"bits_rest_on: op={op!r} is not one of SPEC_RESTS_ON's {sorted(SPEC_RESTS_ON)}")
    if path == "torch":
        return SPEC_RESTS_ON[op]
    for route in ROUTES.get(op, ()):
        if route.path == path:
            return route.rests_on
    raise KeyError(f"bits_rest_on: path={path!r} is not a route of {op} ({[r.path for r in ROUTES.get(op, ())]})")


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
