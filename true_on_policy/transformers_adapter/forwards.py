"""transformers' decoder models on the consistent ops: the forward factories and the patch registry.

:func:`patch_transformers` patches each covered architecture's classes (:mod:`true_on_policy.kernels.architectures`;
the patch list: :mod:`.patches`) with the replacements this module's factories make (:data:`_REPLACEMENTS`):
norms, RoPE, MLP, MoE router/experts, Qwen3.5's gated attention and Gated DeltaNet, the linears
(:class:`~true_on_policy.kernels.modules.ConsistentLinear`, same parameters), and registers the training
attention (:mod:`.training_attention`) as ``"consistent"``. The same module code runs the CPU engine's
packed forward (:mod:`true_on_policy.rollout.packed_forward`).

Flag off: transformers' original code. Flag on: anything not covered (architecture, config
feature, attention implementation, 4D masks, HF ``Cache``, linears that are not consistent) raises
an error naming it, never a silent fallback. Details: docs/true_on_policy.md.
"""

from __future__ import annotations

import functools
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from true_on_policy import patching
from true_on_policy.kernels import architectures, gated_delta, moe, ops, sequence_parallel
from true_on_policy.kernels.architectures import UnsupportedFeatureError
from true_on_policy.kernels.modules import ConsistentLinear, ConsistentLMHead, require_consistent_linears, require_silu
from true_on_policy.transformers_adapter import patches
from true_on_policy.transformers_adapter.training_attention import (
    ATTENTION_ROLES,
    ATTN_IMPLEMENTATION,
    ROLLOUT_KWARG,
    attention_function,
    mask_function,
    sequence_positions,
    training_layout,
)

__all__ = [
    "ROPE_CARRIER",
    "check_model",
    "convert_model",
    "gated_delta_weights",
    "is_patched",
    "patch_transformers",
    "unpatch_transformers",
]


def _swap_linears(module: nn.Module) -> None:
    for child in module.modules():
        if type(child) is nn.Linear:
            child.__class__ = ConsistentLinear


def _swap_lm_head(model: nn.Module) -> None:
    head = getattr(model, "lm_head", None)
    if type(head) in (nn.Linear, ConsistentLinear):
        head.__class__ = ConsistentLMHead


# ----------------------------------------------------------------------------------------------
# Patched forwards (each falls back to transformers' original when the flag is off)
# ----------------------------------------------------------------------------------------------

def make_rms_norm_forward(original):
    @functools.wraps(original)
    def forward(self, hidden_states):
        if not ops.enabled():
            return original(self, hidden_states)
        return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)

    return forward


def make_unit_offset_norm_forward(original):
    @functools.wraps(original)
    def forward(self, x):
        if not ops.enabled():
            return original(self, x)
        return ops.rms_norm(x, self.weight, self.eps, unit_offset=True)

    return forward


def make_gated_rms_norm_forward(original):
    @functools.wraps(original)
    def forward(self, hidden_states, gate=None):
        if not ops.enabled():
            return original(self, hidden_states, gate)
        if gate is None:
            raise UnsupportedFeatureError(f"true_on_policy: {type(self).__name__} without a gate is not covered")
        return gated_delta.gated_rms_norm(hidden_states, gate, self.weight, self.variance_epsilon)

    return forward


def _check_attn_implementation(config) -> None:
    impl = getattr(config, "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        raise UnsupportedFeatureError(
            f"true_on_policy: attention implementation {impl!r} is not consistent; build the model with "
            f'attn_implementation="{ATTN_IMPLEMENTATION}" (after patch_transformers())'
        )


def _rope_rows(module, position_ids: torch.Tensor):
    cached = module.__dict__.get("_true_on_policy_rope")
    if cached is None or cached[0] != position_ids.device:
        cos, sin = ops.rope_table(module.config, device=position_ids.device)
        cached = (position_ids.device, cos, sin)
        module.__dict__["_true_on_policy_rope"] = cached
    _, cos, sin = cached
    if position_ids.numel():
        low, high = (int(x) for x in torch.aminmax(position_ids))
        if low < 0 or high >= cos.shape[0]:
            raise UnsupportedFeatureError(
                f"true_on_policy: position {high if high >= cos.shape[0] else low} is outside the RoPE table "
                f"[0, max_position_embeddings={cos.shape[0]})"
            )
    return cos[position_ids], sin[position_ids]


# The fp32 table rows travel from the rotary embedding to apply_rotary_pos_emb as int32 bit patterns.
# They pass through each decoder layer's arguments, and a wrapper may cast every floating argument
# of a layer to its compute dtype: verl's FSDP engine builds FSDP2's MixedPrecisionPolicy with
# cast_forward_inputs=True, which would hand a bf16 run the table rounded to bf16 while the rollout
# rotates with the fp32 table. No mixed-precision cast touches an integer tensor.
ROPE_CARRIER = torch.int32


def make_rotary_forward(original):
    @functools.wraps(original)
    def forward(self, x, position_ids):
        if not ops.enabled():
            return original(self, x, position_ids)
        _check_attn_implementation(self.config)
        if position_ids.dim() == 3:  # Qwen3.5's mRoPE rows (temporal, height, width): one row for text
            position_ids = ops.text_positions(position_ids)
        cos, sin = _rope_rows(self, position_ids)
        return cos.view(ROPE_CARRIER), sin.view(ROPE_CARRIER)

    return forward


def _table_rows(rows: torch.Tensor) -> torch.Tensor:
    if rows.dtype != ROPE_CARRIER:
        raise UnsupportedFeatureError(
            f"true_on_policy: apply_rotary_pos_emb got position embeddings of dtype {rows.dtype}, not the "
            "consistent rotary embedding's fp32 rows (carried as int32): the model's rotary embedding is not covered"
        )
    return rows.view(torch.float32)


def make_apply_rotary(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not ops.enabled():
            return original(q, k, cos, sin, unsqueeze_dim)
        cos, sin, d = _table_rows(cos), _table_rows(sin), unsqueeze_dim
        if q.shape[:d] + q.shape[d + 1 :] == k.shape[:d] + k.shape[d + 1 :]:  # one call; elementwise: same bits
            both = ops.apply_rope(torch.cat([q, k], dim=d), cos, sin, d)
            return both.split([q.shape[unsqueeze_dim], k.shape[unsqueeze_dim]], dim=unsqueeze_dim)
        return ops.apply_rope(q, cos, sin, unsqueeze_dim), ops.apply_rope(k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


def make_mlp_forward(original):
    @functools.wraps(original)
    def forward(self, x):
        if not ops.enabled():
            return original(self, x)
        require_silu(self)
        require_consistent_linears(self, ("gate_proj", "up_proj", "down_proj"))
        return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x)))

    return forward


def _router_forward(original, renormalize: bool | None):
    @functools.wraps(original)
    def forward(self, hidden_states):
        if not ops.enabled():
            return original(self, hidden_states)
        keep = self.norm_topk_prob if renormalize is None else renormalize
        return moe.route(hidden_states.reshape(-1, self.hidden_dim), self.weight, self.top_k, keep)

    return forward


def make_router_forward(original):
    return _router_forward(original, None)


def make_renormalizing_router_forward(original):
    """Qwen3.5-MoE's router: no ``norm_topk_prob`` switch, it always renormalizes its top-k weights."""
    return _router_forward(original, True)


def make_experts_forward(original):
    @functools.wraps(original)
    def forward(self, hidden_states, top_k_index, top_k_weights):
        if not ops.enabled():
            return original(self, hidden_states, top_k_index, top_k_weights)
        require_silu(self)
        moe.check_expert_layout(self)
        return moe.experts_forward(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)

    return forward


def make_shared_expert_moe_forward(original):
    """Qwen3.5-MoE's block: the (patched) router and experts, plus :func:`moe.shared_expert`, added in the
    hidden dtype as transformers adds them."""

    @functools.wraps(original)
    def forward(self, hidden_states):
        if not ops.enabled():
            return original(self, hidden_states)
        shared = self.shared_expert
        require_silu(shared)
        require_consistent_linears(shared, ("gate_proj", "up_proj", "down_proj"))
        require_consistent_linears(self, ("shared_expert_gate",))
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        _, weights, experts = self.gate(flat)
        routed = self.experts(flat, experts, weights)
        added = moe.shared_expert(flat, (shared.gate_proj.weight, shared.up_proj.weight), shared.down_proj.weight,
                                  self.shared_expert_gate.weight)
        return (routed + added).reshape(hidden_states.shape)

    return forward


def make_decoder_layer_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _swap_linears(self)

    return __init__


def make_causal_lm_init(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        if ops.enabled():
            architectures.check_config(config)  # an uncovered feature is refused before the model is built
        original(self, config, *args, **kwargs)
        _swap_lm_head(self)

    return __init__


def make_causal_lm_forward(original):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if ops.enabled():
            if not (self.__dict__.get(_CHECKED) and isinstance(getattr(self, "lm_head", None), ConsistentLMHead)):
                check_model(self)
        return original(self, *args, **kwargs)

    return forward


_CHECKED = "_true_on_policy_checked"


def built_features(model: nn.Module) -> dict[str, bool]:
    """What the transformers model built, in the terms of :class:`architectures.Features`."""
    attention = next(m for m in model.modules() if isinstance(m, patches.covered(*ATTENTION_ROLES)))
    built = {
        "qkv_bias": getattr(attention.q_proj, "bias", None) is not None,
        "o_bias": getattr(attention.o_proj, "bias", None) is not None,
        "qk_norm": hasattr(attention, "q_norm"),
        # transformers keeps one rotary embedding per model: its inverse frequencies, one per rotated pair
        "rotary_dim": 2 * next(m for m in model.modules() if hasattr(m, "inv_freq")).inv_freq.numel(),
    }
    mlp = next((m for m in model.modules() if isinstance(m, patches.covered("mlp"))), None)
    if mlp is not None:  # none in a model of MoE layers only
        built["mlp_bias"] = getattr(mlp.gate_proj, "bias", None) is not None
    linear = next((m for m in model.modules() if isinstance(m, patches.covered("gated_delta_net"))), None)
    built["linear_attention"] = None if linear is None else (
        linear.num_k_heads, linear.num_v_heads, linear.head_k_dim, linear.head_v_dim, linear.conv_kernel_size)
    built["shared_expert"] = any(isinstance(m, patches.covered("shared_expert_moe")) for m in model.modules())
    return built


def _check_still_patched(model: nn.Module) -> None:
    """A Gated DeltaNet forward replaced after patch_transformers() (e.g. by verl's monkey patch for the
    vision-language model types) would run instead of the consistent one: refused, naming it."""
    for module in model.modules():
        if isinstance(module, patches.covered("gated_delta_net")) and not patching.is_replacement(type(module).forward):
            found = type(module).forward
            raise UnsupportedFeatureError(
                f"true_on_policy: {type(module).__name__}.forward is {found.__module__}.{found.__qualname__}, "
                "set after patch_transformers(): the consistent Gated DeltaNet would not run"
            )


def check_model(model: nn.Module) -> None:
    """With the flag on, once per model: its config is covered (:func:`architectures.check_config`),
    its modules are what the architecture table describes, its linears are consistent (a model
    built before patch_transformers() is converted here). UnsupportedFeatureError otherwise."""
    features = architectures.check_config(model.config)
    if not isinstance(getattr(model, "lm_head", None), ConsistentLMHead):
        convert_model(model)  # a model built before patch_transformers(): same result as building after
        if not isinstance(getattr(model, "lm_head", None), ConsistentLMHead):
            raise UnsupportedFeatureError(
                f"true_on_policy: {type(model).__name__}.lm_head is a {type(model.lm_head).__name__}, "
                "not a plain nn.Linear that could become a ConsistentLMHead"
            )
    architectures.check_built(features, built_features(model), "transformers")
    _check_still_patched(model)
    model.__dict__[_CHECKED] = True



# ----------------------------------------------------------------------------------------------
# Qwen3.5: gated attention, Gated DeltaNet layers and the packed sequences they need
# ----------------------------------------------------------------------------------------------


def make_gated_attention_forward(original):
    """Qwen3.5's attention: transformers' steps, on the consistent ops; its ``sigmoid(gate)`` through
    :func:`ops.sigmoid_gate` (torch's sigmoid kernel is not position-invariant)."""

    @functools.wraps(original)
    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        if not ops.enabled():
            return original(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        shape = hidden_states.shape[:-1]
        query, gate = torch.chunk(self.q_proj(hidden_states).view(*shape, -1, 2 * self.head_dim), 2, dim=-1)
        query = self.q_norm(query).transpose(1, 2)
        key = self.k_norm(self.k_proj(hidden_states).view(*shape, -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(hidden_states).view(*shape, -1, self.head_dim).transpose(1, 2)
        rotate = sys.modules[type(self).__module__].apply_rotary_pos_emb  # the module's own: patched (and recorded)
        query, key = rotate(query, key, *position_embeddings)
        if past_key_values is not None:  # HF caches: refused by the attention function on the continuation
            key, value = past_key_values.update(key, value, self.layer_idx)
        dropout = self.attention_dropout if self.training else 0.0
        out, weights = attention_function(self, query, key, value, attention_mask, self.scaling, dropout, **kwargs)
        gated = ops.sigmoid_gate(out.reshape(*shape, -1), gate.reshape(*shape, -1))
        return self.o_proj(gated), weights

    return forward


PACKING_KWARG = "true_on_policy_packing"  # the text model hands its Gated DeltaNet layers a _Packing


class _Packing(NamedTuple):
    """The sequences of a training batch [B, T]: ``index`` the flat positions (into B * T) of its valid
    tokens in order (None: every token), ``bounds`` the cu_seqlens of the sequences over them."""

    index: torch.Tensor | None
    bounds: torch.Tensor


def _packing(position_ids, attention_mask, batch: int, length: int, device) -> _Packing:
    """Sequences as the attention sees them (:func:`training_layout`): a padded row is one sequence, a
    packed row (verl's remove-padding layout) splits where its positions do not continue (e.g. restart at 0)."""
    if position_ids is not None and position_ids.dim() == 3:  # mRoPE rows: the text row
        position_ids = position_ids[0]
    seg, _, valid = training_layout(position_ids, attention_mask, batch, length, device)
    valid = valid.reshape(-1)
    counts = torch.unique_consecutive(seg.reshape(-1)[valid], return_counts=True)[1]
    bounds = F.pad(counts.cumsum(0), (1, 0))
    return _Packing(None if bool(valid.all()) else torch.nonzero(valid)[:, 0], bounds)


def make_text_model_forward(original):
    """The text model computes each layer's packed sequences once from ``position_ids`` (transformers hands
    the Gated DeltaNet layers neither them nor ``cu_seqlens``) and passes them on in ``PACKING_KWARG``."""

    @functools.wraps(original)
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        if ops.enabled() and kwargs.get(ROLLOUT_KWARG) is None:
            source = input_ids if input_ids is not None else inputs_embeds
            batch, length = source.shape[:2]
            layers_ids, g = position_ids, sequence_parallel.group()
            if g is not None:  # Ulysses: the layers' sequences are those of the whole packed row
                layers_ids = sequence_positions(position_ids, g)
                length = layers_ids.shape[-1]
            kwargs[PACKING_KWARG] = _packing(layers_ids, attention_mask, batch, length, source.device)
        return original(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)

    return forward


def gated_delta_weights(module) -> dict:
    return dict(conv_weight=module.conv1d.weight, A_log=module.A_log, dt_bias=module.dt_bias,
                norm_weight=module.norm.weight, head_k_dim=module.head_k_dim, head_v_dim=module.head_v_dim,
                eps=module.layer_norm_epsilon)


def _check_gated_delta_call(module, cache_params) -> None:
    require_consistent_linears(module, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"))
    if module.activation != "silu" or module.conv1d.bias is not None:
        raise UnsupportedFeatureError(f"true_on_policy: {type(module).__name__} with activation "
                                      f"{module.activation!r} / a conv bias is not covered (silu, no bias)")
    if cache_params is not None and cache_params.has_previous_state(module.layer_idx):
        raise UnsupportedFeatureError(
            "true_on_policy: HF Cache objects / past_key_values are not supported; use consistent_model.forward_packed"
        )


def _layer_packing(kwargs, batch: int) -> _Packing:
    packing = kwargs.get(PACKING_KWARG)
    if packing is not None:
        return packing
    if kwargs.get("cu_seqlens") is not None and batch == 1:  # verl's decoder layer (its Qwen3.5 patch) passes these
        return _Packing(None, kwargs["cu_seqlens"].reshape(-1))
    raise UnsupportedFeatureError(
        "true_on_policy: a Gated DeltaNet layer was called without its sequences' boundaries (the text model's "
        "forward hands them over): call the model, not the layer alone"
    )


def _sequence_parallel_gated_delta(module, projected, packing, g) -> torch.Tensor:
    """Ulysses: this rank's tokens of (qkv, z, a, b) -> the whole sequence of its value heads (with their key
    heads, conv channels, A_log, dt_bias) -> :func:`gated_delta.gated_delta_net_varlen` -> its tokens of y."""
    world, rank = dist.get_world_size(g), dist.get_rank(g)
    kd, vd, nv = module.key_dim, module.value_dim, module.num_v_heads
    if module.num_k_heads % world or nv % world:
        raise UnsupportedFeatureError(f"true_on_policy: linear_num_key_heads={module.num_k_heads} / "
                                      f"linear_num_value_heads={nv} do not divide by ulysses_sequence_parallel_size={world}")
    if packing.index is not None:
        raise UnsupportedFeatureError("true_on_policy: Ulysses sequence parallelism takes one packed row without padding")
    sizes = [kd, kd, vd, vd, nv, nv]  # q | k | v | z | a | b
    local = sequence_parallel.sequence_to_heads(
        sequence_parallel.rank_blocks(torch.cat(projected, dim=1), sizes, world), g)
    qkv, z, a, b = torch.split(local, [(2 * kd + vd) // world, vd // world, nv // world, nv // world], dim=1)
    weights = gated_delta_weights(module)
    weights["conv_weight"] = sequence_parallel.rank_channels(weights["conv_weight"], [kd, kd, vd], world, rank, dim=0)
    for name in ("A_log", "dt_bias"):
        weights[name] = torch.chunk(weights[name], world)[rank]
    y, _ = gated_delta.gated_delta_net_varlen(qkv, z, a, b, cu_seqlens=packing.bounds, **weights)
    return sequence_parallel.heads_to_sequence(y, g)


def make_gated_delta_net_forward(original):
    """The Gated DeltaNet layer on :func:`gated_delta.gated_delta_net_varlen` between consistent linears: each
    packed sequence from a fresh state, none leaking into the next. In the rollout
    (:mod:`true_on_policy.rollout.packed_forward`) each request carries its state (flag off there: transformers'
    own torch code per request)."""

    @functools.wraps(original)
    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        rollout = kwargs.get(ROLLOUT_KWARG)
        g = sequence_parallel.group() if rollout is None else None
        if not ops.enabled() and rollout is None:
            if g is not None:
                raise UnsupportedFeatureError(f"true_on_policy: {type(self).__name__} under Ulysses sequence "
                                              "parallelism runs on the consistent kernels only (the flag on)")
            return original(self, hidden_states, cache_params, attention_mask, **kwargs)
        if ops.enabled():
            _check_gated_delta_call(self, cache_params)
        batch, length, _ = hidden_states.shape
        projected = [projection(hidden_states).reshape(batch * length, -1)
                     for projection in (self.in_proj_qkv, self.in_proj_z, self.in_proj_a, self.in_proj_b)]
        if rollout is not None:
            return self.out_proj(rollout.gated_delta(self, projected)[None])
        packing = _layer_packing(kwargs, batch)
        if g is not None:
            y = _sequence_parallel_gated_delta(self, projected, packing, g)
            return self.out_proj(y.reshape(batch, length, -1))
        if packing.index is not None:
            projected = [x[packing.index] for x in projected]
        y, _ = gated_delta.gated_delta_net_varlen(*projected, cu_seqlens=packing.bounds, **gated_delta_weights(self))
        if packing.index is not None:
            y = y.new_zeros(batch * length, y.shape[-1]).index_copy(0, packing.index, y)
        return self.out_proj(y.reshape(batch, length, -1))

    return forward



# ----------------------------------------------------------------------------------------------
# patch / unpatch
# ----------------------------------------------------------------------------------------------


# role of transformers_adapter.patches -> the factory of its replacement (the patched forwards above)
_REPLACEMENTS = {
    "rms_norm": make_rms_norm_forward,
    "rotary": make_rotary_forward,
    "apply_rotary": make_apply_rotary,
    "mlp": make_mlp_forward,
    "decoder_layer": make_decoder_layer_init,
    "causal_lm": make_causal_lm_init,
    "causal_lm_forward": make_causal_lm_forward,
    "router": make_router_forward,
    "experts": make_experts_forward,
    "unit_offset_norm": make_unit_offset_norm_forward,
    "gated_attention": make_gated_attention_forward,
    "renormalizing_router": make_renormalizing_router_forward,
    "shared_expert_moe": make_shared_expert_moe_forward,
    "gated_delta_net": make_gated_delta_net_forward,
    "gated_rms_norm": make_gated_rms_norm_forward,
    "text_model": make_text_model_forward,
}


def is_patched() -> bool:
    return patches.applied()


def patch_transformers() -> None:
    """Patch transformers' classes of every covered architecture (:mod:`true_on_policy.kernels.architectures`)
    with this module's code and register the attention ``"consistent"`` (:mod:`.training_attention`), through
    the checked :mod:`true_on_policy.transformers_adapter.patches`.

    Idempotent; class-level, so it covers every model built afterwards in this process (call it in
    each worker process before the model is built). Behaviour changes only while the flag is on.
    """
    patches.apply(_REPLACEMENTS, ATTN_IMPLEMENTATION, (attention_function, mask_function))


def unpatch_transformers() -> None:
    """Undo :func:`patch_transformers` (classes restored, attention name unregistered).

    Modules already converted keep their ConsistentLinear class; with the flag off it is F.linear.
    """
    patches.revert(ATTN_IMPLEMENTATION)


def convert_model(model: nn.Module) -> nn.Module:
    """Convert a model built before :func:`patch_transformers` in place (idempotent): the plain
    ``nn.Linear`` of its decoder layers become :class:`ConsistentLinear`, the causal LM's
    ``lm_head`` a :class:`ConsistentLMHead`. The causal LM's forward does this by itself on its
    first call with the flag on."""
    for module in model.modules():
        if isinstance(module, patches.covered("decoder_layer")):
            _swap_linears(module)
        if isinstance(module, patches.covered("causal_lm")):
            _swap_lm_head(module)
    return model
