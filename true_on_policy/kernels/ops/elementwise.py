"""``fixed_sum`` and the elementwise activations, each position-invariant.

:func:`fixed_sum` sums a row as a fixed pairwise tree of elementwise adds; :func:`silu`, :func:`silu_mul`,
:func:`sigmoid` and :func:`sigmoid_gate` are built from fp32 ``exp`` and correctly rounded ``+ /``
(torch's sigmoid/silu kernels are not position-invariant). A row's bits never depend on the rows around it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from true_on_policy.kernels.ops.dispatch import _route

def fixed_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, keepdim, as a fixed pairwise tree of elementwise adds.

    Invariant: element ``i`` is paired with ``i + n/2`` (zero-padded to a power of two) at every
    level, so a row's sum depends only on the row's values, never on the number of rows, the
    row's position, the threads or the vector width (elementwise adds are correctly rounded).
    Its gradient is the one autograd derives through the tree (:class:`_FixedSum`).
    Bits: the project's order, on every route.
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



def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` computed as ``x / (1 + exp(-x))`` in fp32, cast once to ``x``'s dtype.

    Invariant: built only from fp32 ``exp`` (measured position-invariant) and correctly rounded
    ``+`` and ``/``; torch's ``sigmoid``/``silu`` kernels give different bits in a tensor's tail.
    Bits: rest on vml_exp (torch's fp32 exp).
    """
    h = x.to(torch.float32)
    return (h / (1.0 + torch.exp(-h))).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's ``silu(gate) * up``: :func:`silu`, then the product in the operands' dtype.

    Without autograd on CPU one native pass after torch's ``exp`` -- the same bits as this code.
    Bits: rest on vml_exp (the native pass calls torch's exp too).
    """
    if (kernel := _route("silu_mul", gate.device, gate, up)).run:
        return kernel.run(gate, up)
    return silu(gate) * up


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` in fp32 (torch's sigmoid kernel is not position-invariant; fp32 ``exp`` and
    correctly rounded ``+ /`` are).

    Bits: rest on vml_exp."""
    return 1.0 / (1.0 + torch.exp(-x.to(torch.float32)))


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` (Qwen3.5's gated attention output, the shared expert's gate), in ``x``'s dtype.

    transformers' rounding points: the sigmoid rounded to the operands' dtype (``torch.sigmoid`` of a
    tensor of that dtype), then the product in that dtype; the sigmoid itself is :func:`sigmoid`. ``x``
    and ``gate`` must share a dtype; ``gate`` broadcasts (the shared expert's gate is one column).
    Bits: rest on vml_exp (:func:`sigmoid`).
    """
    if gate.dtype != x.dtype:
        raise ValueError(f"sigmoid_gate: x is {x.dtype}, gate is {gate.dtype}; they must share a dtype")
    return x * sigmoid(gate).to(x.dtype)
