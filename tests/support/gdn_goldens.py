"""Golden outputs of the Gated DeltaNet's CPU-independent pieces, on fixed seeded inputs (issue 58).

Which piece: the delta rule's core (:func:`gated_delta.delta_rule`: fp32 ``* + -`` and :func:`ops.fixed_sum`'s
tree of elementwise adds; the C++ core built with ``-ffp-contract=off``). Every operation is correctly rounded
IEEE arithmetic in an order the project fixes, with no BLAS, no ``exp`` and no ``sqrt``, so the bits are the same
on any x86 CPU (issue 54): one file, ``tests/support/data/gdn_goldens.pt``, not keyed by CPU capability. The
pieces around it (gating, the conv's and the gated norm's SiLU, the l2norm) rest on torch's ``exp`` and ``sqrt``
kernels -- MKL's on x86, and torch's fp32 ``sqrt`` is not the IEEE square root there (measured on an AMD EPYC, see
``csrc/norms.cpp``), so their bits may follow the CPU vendor; they stay out of this file (the layer is held bitwise across layouts and engines by ``test_qwen35_model.py``). Written by
``python tests/support/gdn_goldens.py --write`` from the kernels' torch code (``ops.switched(native=False)``);
``tests/unit/test_kernel_goldens.py`` asserts ``torch.equal`` for every entry on the current routes.
"""

from __future__ import annotations

import argparse
import pathlib

import torch

PATH = pathlib.Path(__file__).parent / "data" / "gdn_goldens.pt"


def _randn(g, *shape, scale=1.0):
    """Dyadic values drawn as integers: torch's ``randn`` / ``rand`` kernels give other bits on other CPU
    capabilities (their ``log`` / ``cos``), ``randint`` and a power-of-two scale do not."""
    return torch.randint(-3 * 2**12, 3 * 2**12, shape, generator=g).to(torch.float32) * (scale / 2**12)


def _rand(g, *shape):
    return torch.randint(0, 2**12, shape, generator=g).to(torch.float32) / 2**12


def compute() -> dict[str, torch.Tensor]:
    """Every entry: the core over a right-padded batch (a carried state, one row shorter) and decode steps; q and k
    dyadic values of norm about 0.4 to 1.2 (the l2norm's ``sqrt`` kept out)."""
    from true_on_policy.kernels import gated_delta

    g = torch.Generator().manual_seed(58)
    out: dict[str, torch.Tensor] = {}
    for name, (batch, steps, heads, dk, dv) in {"prefill": (2, 70, 4, 16, 16), "decode": (3, 1, 2, 32, 16)}.items():
        q = _randn(g, batch, steps, heads, dk, scale=2.0 ** -4)  # |q| ~ dk ** -0.5 at dk 16 / 32, as scaled
        k = _randn(g, batch, steps, heads, dk, scale=2.0 ** -3)  # beta |k|^2 < 2: the recurrence stays bounded
        v = _randn(g, batch, steps, heads, dv)
        decay = _rand(g, batch, steps, heads) * 0.5 + 0.5  # exp(g) in (0.5, 1): given, not computed
        beta = _rand(g, batch, steps, heads)
        state = _randn(g, batch, heads, dv, dk, scale=0.125)
        lengths = torch.tensor([steps] + [max(steps - 13, 0)] * (batch - 1))
        with torch.no_grad():
            o, s = gated_delta.delta_rule(q, k, v, decay, beta, state, lengths)
        out[f"gdn/delta_rule/{name}/out"], out[f"gdn/delta_rule/{name}/state"] = o, s
    return {k: v.detach().clone() for k, v in out.items()}


def load() -> dict[str, torch.Tensor]:
    return torch.load(PATH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"(re)write {PATH.name}")
    args = parser.parse_args()
    from true_on_policy.kernels import ops

    with ops.switched(native=False):
        goldens = compute()
    print(f"{len(goldens)} entries, {sum(v.numel() * v.element_size() for v in goldens.values()) / 1e6:.2f} MB")
    if args.write:
        torch.save(goldens, PATH)
        print(f"wrote {PATH}")


if __name__ == "__main__":
    main()
