"""Fault injection (demos and tests): plant a known inconsistency in ONE model copy.

Attention and router faults flip :class:`true_on_policy.kernels.ops.Fault` switches of the real
kernels for one layer, so the planted fault never drifts from the kernel it perturbs.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from true_on_policy.transformers_adapter.training_attention import ATTN_IMPLEMENTATION, attention_function
from true_on_policy.kernels import ops


FAULTS = {
    "eps": "RMSNorm eps of layers.L.post_attention_layernorm set to 1e-2 (expect: implementation)",
    "weight": "one element of layers.L.self_attn.v_proj.weight perturbed (expect: weights)",
    "bf16-softmax": "attention of layer L accumulates its softmax (probabilities, PV sums, denominator) in bf16, "
    "via an attention implementation registered for that layer only (expect: implementation)",
    "additive-mask": "attention of layer L masks with an additive -1e9 instead of selection, over a KV buffer whose "
    "unwritten slots hold garbage (NaN), like an uninitialised paged cache (expect: implementation, non-finite)",
    "kv-garbage": "control, not a fault: the same garbage KV buffer with the selection mask of the consistent kernel "
    "(expect: no divergence)",
    "router-tiebreak": "MoE router of layer L breaks top-k ties towards the higher expert index: the top-k kernel is "
    "swapped underneath an unchanged module (expect: operator); needs ties, see make_router_ties",
}


NEEDS_CONSISTENT_KERNELS = {"bf16-softmax", "additive-mask", "kv-garbage", "router-tiebreak"}


def _layer_module(model: nn.Module, layer: int) -> nn.Module:
    layers = model.get_submodule("model.layers")
    if not -len(layers) <= layer < len(layers):
        raise ValueError(f"layer {layer} out of range: the model has {len(layers)} layers")
    return layers[layer]


def _install_attention_variant(model: nn.Module, layer: int, variant: str, fault: ops.Fault) -> str:
    """Give layer ``layer``'s attention its own config whose ``_attn_implementation`` names the
    consistent attention run with ``fault``'s switches on (registered in transformers' AttentionInterface)."""
    from transformers import AttentionInterface

    def interface(module, query, key, value, attention_mask, **kwargs):
        with ops.switched(fault=fault):  # the real kernel, with the fault's switches on for this call only
            return attention_function(module, query, key, value, attention_mask, **kwargs)

    name = f"{ATTN_IMPLEMENTATION}+{variant}"
    interface.__name__ = interface.__qualname__ = f"attention_{variant.replace('-', '_')}"
    AttentionInterface.register(name, interface)
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    attn = _layer_module(model, layer).self_attn
    config = copy.copy(attn.config)
    config._attn_implementation_internal = name
    attn.config = config
    return name


def make_router_ties(model: nn.Module, layer: int = -1, experts: tuple[int, int] = (0, 1)) -> None:
    """Zero the router rows of two experts in one layer, so their logits are both exactly 0: a tie that
    decides the top-k whenever exactly one other expert scores above 0. Apply to BOTH copies."""
    gate = getattr(getattr(_layer_module(model, layer), "mlp", None), "gate", None)
    if not isinstance(gate, nn.Module) or not hasattr(gate, "top_k"):
        raise ValueError(f"layer {layer} has no MoE router (mlp.gate): a dense model?")
    with torch.no_grad():
        gate.weight[list(experts)] = 0


def inject_fault(model: nn.Module, fault: str, layer: int = -1) -> str:
    """Plant ``fault`` (a key of :data:`FAULTS`) in ``model`` (meant for the rollout copy); returns a
    one-line description of what was changed."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose from {sorted(FAULTS)}")
    n_layers = len(model.get_submodule("model.layers"))
    layer_idx = layer % n_layers if -n_layers <= layer < n_layers else layer
    block = _layer_module(model, layer)
    prefix = f"model.layers.{layer_idx}"
    if fault == "eps":
        norm = block.post_attention_layernorm
        before = norm.variance_epsilon
        norm.variance_epsilon = 1e-2
        return f"eps: {prefix}.post_attention_layernorm.variance_epsilon {before} -> {norm.variance_epsilon}"
    if fault == "weight":
        w = block.self_attn.v_proj.weight
        with torch.no_grad():
            before = float(w[0, 0])
            w[0, 0] += max(abs(before) * 0.05, 1e-2)
            after = float(w[0, 0])
        return f"weight: {prefix}.self_attn.v_proj.weight[0, 0] {before:.6g} -> {after:.6g}"
    if fault == "bf16-softmax":
        name = _install_attention_variant(model, layer_idx, "bf16_softmax", ops.Fault(softmax_dtype=torch.bfloat16))
        return f"bf16-softmax: {prefix}.self_attn uses attention implementation {name!r} (softmax accumulated in bf16)"
    if fault == "additive-mask":
        name = _install_attention_variant(
            model, layer_idx, "additive_mask", ops.Fault(additive_mask=True, kv_garbage=True)
        )
        return (
            f"additive-mask: {prefix}.self_attn uses {name!r} (additive -1e9 mask, values not selected, unwritten KV "
            "slots hold NaN garbage)"
        )
    if fault == "kv-garbage":
        name = _install_attention_variant(model, layer_idx, "kv_garbage", ops.Fault(kv_garbage=True))
        return (
            f"kv-garbage (control): {prefix}.self_attn uses {name!r} (NaN garbage in unwritten KV slots, "
            "selection mask)"
        )
    if fault == "router-tiebreak":
        mlp = getattr(block, "mlp", None)
        gate = getattr(mlp, "gate", None)
        if not isinstance(gate, nn.Module) or not hasattr(gate, "top_k"):
            raise ValueError(f"{prefix}.mlp has no MoE router (mlp.gate): a dense model?")
        state = {}

        def swap_in(module, args):  # the real top-k kernel, its tie-break switch flipped for this gate
            state["previous"] = ops.set_switches(fault=ops.Fault(router_ties_to_higher=True)).fault

        def swap_out(module, args, output):
            if "previous" in state:
                ops.set_switches(fault=state.pop("previous"))

        gate.register_forward_pre_hook(swap_in)
        gate.register_forward_hook(swap_out, always_call=True)  # restored even if the forward raises
        return f"router-tiebreak: {prefix}.mlp.gate's top-k kernel breaks ties towards the higher expert index"
    raise AssertionError(fault)

