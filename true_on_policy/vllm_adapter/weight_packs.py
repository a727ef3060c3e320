"""Weights laid out once for their native path (:func:`ops.pack_weight`, :func:`ops.pack_experts`), which
decode's few rows read: built on first use, kept on the weight (or the experts' module) and dropped by
:mod:`.patches` whenever vLLM writes or post-processes the weights, to be rebuilt from them. The weights
themselves stay unpacked (verl's per-step sync writes into them).
"""

from __future__ import annotations

from true_on_policy.kernels import ops

_PACKS = "_true_on_policy_packs"


def _kept_packs(holder, build):
    """``build()`` -- ``holder``'s weights laid out once -- kept on ``holder`` (a weight, or the experts'
    module) from its first use until :func:`drop_packs`: :mod:`.patches` drops them whenever vLLM writes
    or post-processes the weights."""
    packs = holder.__dict__.get(_PACKS)
    if packs is None:
        packs = build()
        holder.__dict__[_PACKS] = packs
    return packs


def linear_packs(layer, sizes: list[int]) -> tuple:
    """The :func:`ops.pack_weight` of each output partition of ``layer.weight`` (None where a linear reads
    none), built on first use after every weight load; kept on the weight, which a tied LM head shares
    with the embedding that loads it."""
    weight = layer.weight

    def build():
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return tuple(ops.pack_weight(weight[s : s + size]) for s, size in zip(starts, sizes))

    return _kept_packs(weight, build)


def weight_pack(layer):
    """:func:`linear_packs` of a linear read whole (one partition)."""
    return linear_packs(layer, [layer.weight.shape[0]])[0]


def expert_weights(holder) -> tuple[list, list, tuple | None]:
    """The experts' weights as the per-expert views :func:`moe.moe_experts` takes (gate_up, down) and laid out
    once for its native call (:func:`ops.pack_experts`, or None where it reads none), built on first use
    after every weight load."""
    def build():
        gate_up, down = list(holder.w13_weight), list(holder.w2_weight)
        return gate_up, down, ops.pack_experts(gate_up, down)

    return _kept_packs(holder, build)


def drop_packs(holder) -> None:
    """Forget the :func:`linear_packs` or :func:`expert_weights` kept on ``holder`` (being written)."""
    holder.__dict__.pop(_PACKS, None)
