"""transformers' decoder models on the consistent ops, for both engines, same module code.

Training side: :func:`patch_transformers` patches each covered architecture's classes
(:mod:`.architectures`; the patch list: :mod:`true_on_policy.transformers_adapter.patches`): norms,
RoPE, MLP, MoE router/experts, the linears (:class:`ConsistentLinear`, :class:`ConsistentLMHead`,
same parameters) and an attention implementation ``"consistent"`` (:data:`ATTN_IMPLEMENTATION`).
Rollout side: :func:`forward_packed` runs the same model as a ragged continuous batch over
per-request :class:`KVCache` objects.

Flag off: transformers' original code. Flag on: anything not covered (architecture, config
feature, attention implementation, 4D masks, HF ``Cache``, linears that are not consistent) raises
an error naming it, never a silent fallback. Details: docs/true_on_policy.md.
"""

from __future__ import annotations

import functools
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from true_on_policy import patching
from true_on_policy.kernels import architectures, gated_delta, moe, ops
from true_on_policy.kernels.architectures import UnsupportedFeatureError
from true_on_policy.transformers_adapter import patches

__all__ = [
    "ATTN_IMPLEMENTATION",
    "ROLLOUT_KWARG",
    "attn_implementation",
    "ConsistentLinear",
    "ConsistentLMHead",
    "KVCache",
    "UnsupportedFeatureError",
    "convert_model",
    "forward_packed",
    "is_patched",
    "patch_transformers",
    "unpatch_transformers",
]

ATTN_IMPLEMENTATION = "consistent"
ROLLOUT_KWARG = "true_on_policy_rollout"  # model(..., true_on_policy_rollout=<_RolloutBatch>)


def attn_implementation() -> str:
    """The ``attn_implementation`` to build models with: ``"consistent"`` (see patch_transformers)."""
    return ATTN_IMPLEMENTATION


# ----------------------------------------------------------------------------------------------
# Linear modules
# ----------------------------------------------------------------------------------------------


class ConsistentLinear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`ops.linear` while the flag is on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.enabled():
            return ops.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class ConsistentLMHead(ConsistentLinear):
    """The LM head: consistent linear with fp32 logits while the flag is on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.enabled():
            return ops.linear(x, self.weight, self.bias, out_dtype=torch.float32)
        return F.linear(x, self.weight, self.bias)


def _swap_linears(module: nn.Module) -> None:
    for child in module.modules():
        if type(child) is nn.Linear:
            child.__class__ = ConsistentLinear


def _swap_lm_head(model: nn.Module) -> None:
    head = getattr(model, "lm_head", None)
    if type(head) in (nn.Linear, ConsistentLinear):
        head.__class__ = ConsistentLMHead


def _require_consistent_linears(module: nn.Module, names) -> None:
    for name in names:
        child = getattr(module, name)
        if not isinstance(child, ConsistentLinear):
            raise UnsupportedFeatureError(
                f"true_on_policy: {type(module).__name__}.{name} is a {type(child).__name__}, not a "
                "ConsistentLinear: wrapped linears (e.g. LoRA adapters) are not covered; a model built "
                "before patch_transformers() is converted by its causal-LM forward or convert_model(model)"
            )


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


def require_silu(module) -> None:
    act = getattr(module.config, "hidden_act", None)
    if act != "silu":
        raise UnsupportedFeatureError(f"true_on_policy: activation {act!r} is not supported (only 'silu')")


def make_mlp_forward(original):
    @functools.wraps(original)
    def forward(self, x):
        if not ops.enabled():
            return original(self, x)
        require_silu(self)
        _require_consistent_linears(self, ("gate_proj", "up_proj", "down_proj"))
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
        _require_consistent_linears(shared, ("gate_proj", "up_proj", "down_proj"))
        _require_consistent_linears(self, ("shared_expert_gate",))
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
    attention = next(m for m in model.modules() if isinstance(m, patches.covered(*_ATTENTION_ROLES)))
    built = {
        "qkv_bias": getattr(attention.q_proj, "bias", None) is not None,
        "o_bias": getattr(attention.o_proj, "bias", None) is not None,
        "qk_norm": hasattr(attention, "q_norm"),
    }
    mlp = next((m for m in model.modules() if isinstance(m, patches.covered("mlp"))), None)
    if mlp is not None:  # none in a model of MoE layers only
        built["mlp_bias"] = getattr(mlp.gate_proj, "bias", None) is not None
    linear = next((m for m in model.modules() if isinstance(m, patches.covered("gated_delta_net"))), None)
    built["linear_attention"] = None if linear is None else (
        linear.num_k_heads, linear.num_v_heads, linear.head_k_dim, linear.head_v_dim, linear.conv_kernel_size)
    built["shared_expert"] = any(isinstance(m, patches.covered("shared_expert_moe")) for m in model.modules())
    return built


_ATTENTION_ROLES = ("attention", "gated_attention")


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
# Attention interface
# ----------------------------------------------------------------------------------------------

_UNSUPPORTED_ATTENTION_KWARGS = ("s_aux", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def mask_function(
    batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs
):
    """transformers mask function ``"consistent"``: HF's 2D boolean padding mask (or None), as is."""
    return attention_mask


def _check_attention_call(module, attention_mask, dropout, sliding_window, kwargs) -> None:
    if not isinstance(module, patches.covered(*_ATTENTION_ROLES)):
        architectures.check_config(module.config)  # names the architecture
        raise UnsupportedFeatureError(
            f"true_on_policy: attention module {type(module).__name__} is not covered "
            f"(covered: {[c.__name__ for c in patches.covered(*_ATTENTION_ROLES)]})"
        )
    _require_consistent_linears(module, ("q_proj", "k_proj", "v_proj", "o_proj"))
    if sliding_window is not None:
        raise UnsupportedFeatureError(
            f"true_on_policy: sliding window attention (window {sliding_window}) is not supported"
        )
    if dropout:
        raise UnsupportedFeatureError(f"true_on_policy: attention dropout {dropout} is not supported")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise UnsupportedFeatureError("true_on_policy: only 2D padding masks are supported, got a 4D/custom mask")
    for name in _UNSUPPORTED_ATTENTION_KWARGS:
        if kwargs.get(name) is not None:
            raise UnsupportedFeatureError(f"true_on_policy: attention argument {name!r} is not supported")
    if kwargs.get("softcap") is not None:
        raise UnsupportedFeatureError("true_on_policy: attention logit softcapping is not supported")


def _training_layout(position_ids, attention_mask, batch: int, length: int, device):
    """Per token: (segment id, absolute position, valid) for a packed or padded training batch."""
    if position_ids is None:
        position_ids = torch.arange(length, device=device)[None]
    pos = position_ids.to(device).long().expand(batch, length)
    if attention_mask is None:
        valid = torch.ones(batch, length, dtype=torch.bool, device=device)
        starts = torch.ones(batch, length, dtype=torch.bool, device=device)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        seg = (starts.reshape(-1).cumsum(0) - 1).view(batch, length)
    else:
        valid = attention_mask.to(device=device, dtype=torch.bool)
        seg = torch.arange(batch, device=device)[:, None].expand(batch, length)
        marked = torch.where(valid, pos, -1)
        before = torch.cummax(marked, dim=1).values
        before = torch.cat([before.new_full((batch, 1), -1), before[:, :-1]], dim=1)
        if bool((valid & ((pos <= before) | (pos < 0))).any()):
            raise UnsupportedFeatureError(
                "true_on_policy: position_ids of the unmasked tokens must be non-negative and strictly "
                "increasing in each row"
            )
    return seg, pos, valid


class _GridLayout:
    """Where each token of a training batch goes in the [sequence, absolute position] grid."""

    def __init__(self, position_ids, attention_mask, batch, length, num_heads, num_kv_heads, device):
        seg, pos, valid = _training_layout(position_ids, attention_mask, batch, length, device)
        self.valid = valid
        self.all_valid = bool(valid.all())
        self.valid_index = None if self.all_valid else torch.nonzero(valid, as_tuple=True)
        self.s_idx, self.p_idx = seg[valid], pos[valid]
        self.n_seg = int(self.s_idx.max()) + 1 if self.s_idx.numel() else 0
        span = int(self.p_idx.max()) + 1 if self.s_idx.numel() else 0
        self.span = -(-span // ops.KV_BLOCK) * ops.KV_BLOCK  # whole KV blocks: no padding in the kernel
        kv_valid = torch.zeros(self.n_seg, self.span, dtype=torch.bool, device=device)
        kv_valid[self.s_idx, self.p_idx] = True
        q_pos = torch.where(kv_valid, torch.arange(self.span, device=device), -1)
        self.plan = ops.attention_plan(q_pos, kv_valid, num_heads, num_kv_heads) if self.n_seg else None

    def to_grid(self, x):
        """[B, H, T, D] tokens -> [S, H, span, D] grid (zeros where no token)."""
        tokens = x.transpose(1, 2)
        tokens = tokens.reshape(-1, *tokens.shape[2:]) if self.all_valid else tokens[self.valid_index]
        grid = x.new_zeros(self.n_seg, self.span, x.shape[1], x.shape[3])
        return grid.index_put((self.s_idx, self.p_idx), tokens).transpose(1, 2)

    def from_grid(self, grid, batch, length):
        """[S, H, span, D] grid -> [B, T, H, D] tokens (zeros for padding tokens)."""
        tokens = grid.transpose(1, 2)[self.s_idx, self.p_idx]
        if self.all_valid:
            return tokens.view(batch, length, *tokens.shape[1:])
        return grid.new_zeros(batch, length, *tokens.shape[1:]).index_put(self.valid_index, tokens)


_LAYOUT_CACHE: list = []  # one entry: the layout of the last training batch, shared by its layers


def _version(t):
    if t is None:
        return None
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version: never cache their layout
        return object()


def _grid_layout(position_ids, attention_mask, batch, length, num_heads, num_kv_heads, device):
    """The layout of a training batch, computed once and shared by all its layers.

    Cached on the identity (and in-place version) of the ``position_ids`` / mask tensors that
    transformers hands every layer of one forward.
    """
    key = (batch, length, num_heads, num_kv_heads, device, _version(position_ids), _version(attention_mask))
    if position_ids is not None and _LAYOUT_CACHE:
        ids, mask, cached_key, layout = _LAYOUT_CACHE[0]
        if ids is position_ids and mask is attention_mask and cached_key == key:
            return layout
    layout = _GridLayout(position_ids, attention_mask, batch, length, num_heads, num_kv_heads, device)
    if position_ids is not None:  # strong references: the identity check cannot be fooled by id reuse
        _LAYOUT_CACHE[:] = [(position_ids, attention_mask, key, layout)]
    return layout


def _consistent_training_attention(query, key, value, position_ids, attention_mask, scaling):
    batch, hq, length, dim = query.shape
    layout = _grid_layout(position_ids, attention_mask, batch, length, hq, key.shape[1], query.device)
    if layout.n_seg == 0:
        return query.new_zeros(batch, length, hq, dim)
    out = ops.attention(
        layout.to_grid(query), layout.to_grid(key), layout.to_grid(value), None, None, scaling, plan=layout.plan
    )
    return layout.from_grid(out, batch, length)


def _default_training_attention(query, key, value, seg, pos, valid, scaling, dropout):
    """The flag-off path: SDPA with a boolean mask (HF's own semantics, default kernels)."""
    length = query.shape[2]
    index = torch.arange(length, device=query.device)
    mask = (seg[:, :, None] == seg[:, None, :]) & valid[:, None, :] & (index[None, :] <= index[:, None])[None]
    mask = mask | torch.eye(length, dtype=torch.bool, device=query.device)[None]  # padding rows: no NaN
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask[:, None], dropout_p=dropout, scale=scaling, enable_gqa=True
    ).transpose(1, 2)
    return torch.where(valid[:, :, None, None], out, 0.0)


def attention_function(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs
):
    """transformers attention function ``"consistent"``: [B, H, T, D] in, ([B, T, H, D], None) out."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if ops.enabled():
        _check_attention_call(module, attention_mask, dropout, sliding_window, kwargs)
    rollout = kwargs.get(ROLLOUT_KWARG)
    if rollout is not None:
        return rollout.attend(module.layer_idx, query, key, value, scaling), None
    batch, _, length, _ = query.shape
    if key.shape[2] != length:
        raise UnsupportedFeatureError(
            "true_on_policy: HF Cache objects / past_key_values are not supported; use consistent_model.forward_packed"
        )
    position_ids = kwargs.get("position_ids")
    if ops.enabled():
        return _consistent_training_attention(query, key, value, position_ids, attention_mask, scaling), None
    seg, pos, valid = _training_layout(position_ids, attention_mask, batch, length, query.device)
    return _default_training_attention(query, key, value, seg, pos, valid, scaling, dropout), None


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
    """Sequences as the attention sees them (:func:`_training_layout`): a padded row is one sequence, a
    packed row (verl's remove-padding layout) splits where its positions do not continue (e.g. restart at 0)."""
    if position_ids is not None and position_ids.dim() == 3:  # mRoPE rows: the text row
        position_ids = position_ids[0]
    seg, _, valid = _training_layout(position_ids, attention_mask, batch, length, device)
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
            kwargs[PACKING_KWARG] = _packing(position_ids, attention_mask, source.shape[0], source.shape[1],
                                             source.device)
        return original(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)

    return forward


def _gated_delta_weights(module) -> dict:
    return dict(conv_weight=module.conv1d.weight, A_log=module.A_log, dt_bias=module.dt_bias,
                norm_weight=module.norm.weight, head_k_dim=module.head_k_dim, head_v_dim=module.head_v_dim,
                eps=module.layer_norm_epsilon)


def _check_gated_delta_call(module, cache_params) -> None:
    _require_consistent_linears(module, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"))
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


def make_gated_delta_net_forward(original):
    """The Gated DeltaNet layer on :func:`gated_delta.gated_delta_net_varlen` between consistent linears: each
    packed sequence from a fresh state, none leaking into the next. In the rollout (:func:`forward_packed`) each
    request carries its state (flag off there: transformers' own torch code per request)."""

    @functools.wraps(original)
    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        rollout = kwargs.get(ROLLOUT_KWARG)
        if not ops.enabled() and rollout is None:
            return original(self, hidden_states, cache_params, attention_mask, **kwargs)
        if ops.enabled():
            _check_gated_delta_call(self, cache_params)
        batch, length, _ = hidden_states.shape
        projected = [projection(hidden_states).reshape(batch * length, -1)
                     for projection in (self.in_proj_qkv, self.in_proj_z, self.in_proj_a, self.in_proj_b)]
        if rollout is not None:
            return self.out_proj(rollout.gated_delta(self, projected)[None])
        packing = _layer_packing(kwargs, batch)
        if packing.index is not None:
            projected = [x[packing.index] for x in projected]
        y, _ = gated_delta.gated_delta_net_varlen(*projected, cu_seqlens=packing.bounds, **_gated_delta_weights(self))
        if packing.index is not None:
            y = y.new_zeros(batch * length, y.shape[-1]).index_copy(0, packing.index, y)
        return self.out_proj(y.reshape(batch, length, -1))

    return forward


def _stock_gated_delta(module, mixed, z, a, b, state):
    """Flag off, in the rollout: one request's new tokens through transformers' own torch code, as its cached
    forward runs them (chunked for several tokens, recurrent for one) -- a serving engine's default numerics.
    ``state``: (conv (1, C, K - 1), recurrent in transformers' layout) or None."""
    steps, taps = mixed.shape[0], module.conv_kernel_size
    conv = mixed.new_zeros(1, mixed.shape[1], taps - 1) if state is None else state.conv
    full = torch.cat([conv, mixed.T[None]], dim=-1)
    x = F.silu(F.conv1d(full, module.conv1d.weight, module.conv1d.bias, groups=full.shape[1])).transpose(1, 2)
    query, key, value = torch.split(x, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    repeat = module.num_v_heads // module.num_k_heads
    query = query.reshape(1, steps, -1, module.head_k_dim).repeat_interleave(repeat, dim=2)
    key = key.reshape(1, steps, -1, module.head_k_dim).repeat_interleave(repeat, dim=2)
    g = -module.A_log.float().exp() * F.softplus(a[None].float() + module.dt_bias)
    rule = module.recurrent_gated_delta_rule if steps == 1 else module.chunk_gated_delta_rule
    out, recurrent = rule(query, key, value.reshape(1, steps, -1, module.head_v_dim), g=g, beta=b[None].sigmoid(),
                          initial_state=None if state is None else state.recurrent, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
    y = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim)).reshape(steps, -1)
    return y, gated_delta.GatedDeltaState(full[..., full.shape[-1] - (taps - 1):], recurrent)


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
    """Patch transformers' classes of every covered architecture (:mod:`.architectures`) with this
    module's code and register the attention ``"consistent"``, through the checked
    :mod:`true_on_policy.transformers_adapter.patches`.

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


# ----------------------------------------------------------------------------------------------
# Rollout: per-request KV caches and the packed ragged forward
# ----------------------------------------------------------------------------------------------


class KVCache:
    """One request's keys and values for all layers, stored by absolute position; for Gated DeltaNet
    layers (Qwen3.5) its state after the last token (``linear``: layer -> :class:`gated_delta.GatedDeltaState`).

    ``data`` is [capacity, num_layers, 2 (k, v), num_kv_heads, head_dim]: slot ``p`` holds the
    token at absolute position ``p``, so the attention's KV blocks are aligned at absolute
    positions. Capacity grows in whole :data:`consistent_ops.KV_BLOCK` blocks (at least doubling).
    Filled by :func:`forward_packed`, and only after the model call succeeded.
    """

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None
        self._length = 0
        self.linear: dict[int, gated_delta.GatedDeltaState] = {}  # Gated DeltaNet layer -> the state after the last token

    @property
    def length(self) -> int:
        return self._length

    def __len__(self) -> int:
        return self._length

    def keys(self, layer: int) -> torch.Tensor:
        """[num_kv_heads, length, head_dim] (a view)."""
        return self.data[: self._length, layer, 0].transpose(0, 1)

    def values(self, layer: int) -> torch.Tensor:
        """[num_kv_heads, length, head_dim] (a view)."""
        return self.data[: self._length, layer, 1].transpose(0, 1)

    def filled(self) -> torch.Tensor | None:
        """[length, num_layers, 2, num_kv_heads, head_dim] (a view), None while empty."""
        return None if self.data is None else self.data[: self._length]

    def truncate(self, length: int) -> None:
        """Forget the entries at positions >= ``length`` (e.g. to decode the same step again)."""
        if not 0 <= length <= self._length:
            raise ValueError(f"KVCache: cannot truncate a cache of {self._length} entries to {length}")
        if self.linear and length != self._length:
            raise ValueError(f"KVCache: cannot truncate to {length} a cache carrying Gated DeltaNet states (the "
                             f"state after token {self._length - 1} holds every token before it)")
        self._length = length

    def append(self, kv: torch.Tensor) -> None:
        """Append ``kv`` [n, num_layers, 2, num_kv_heads, head_dim] at positions length .. length+n-1."""
        n = kv.shape[0]
        need = self._length + n
        if self.data is not None and self.data.shape[1:] != kv.shape[1:]:
            raise ValueError(f"KVCache: appending {tuple(kv.shape)} to a cache of {tuple(self.data.shape)}")
        if self.data is None or self.data.shape[0] < need:
            capacity = -(-need // ops.KV_BLOCK) * ops.KV_BLOCK
            if self.data is not None:
                capacity = max(capacity, 2 * self.data.shape[0])
            grown = kv.new_zeros(capacity, *kv.shape[1:])
            if self.data is not None and self._length:
                grown[: self._length] = self.data[: self._length]
            self.data = grown
        self.data[self._length : need] = kv
        self._length = need


class _RolloutBatch:
    """The layout of one :func:`forward_packed` call, carried to every attention call.

    Holds the keys/values of all requests as a grid [S, span, num_layers, 2, Hkv, D] indexed by
    absolute position (the caches' contents, then each layer writes its new tokens).
    """

    def __init__(self, positions, seq_lens, caches, config, dtype):
        device = positions.device
        S = len(seq_lens)
        self.seq_lens = seq_lens
        self.caches = caches
        self.prefix = [c.length for c in caches]
        self.total = [p + n for p, n in zip(self.prefix, seq_lens)]
        lens = torch.tensor(seq_lens, device=device)
        self.seg = torch.repeat_interleave(torch.arange(S, device=device), lens)
        self.local = torch.arange(positions.numel(), device=device) - (torch.cumsum(lens, 0) - lens)[self.seg]
        self.expected = torch.tensor(self.prefix, device=device)[self.seg] + self.local
        self.pos = positions
        self.span = -(-max(self.total) // ops.KV_BLOCK) * ops.KV_BLOCK  # whole KV blocks
        self.q_len = max(seq_lens)
        hkv = config.num_key_value_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        shape = (config.num_hidden_layers, 2, hkv, dim)
        self.grid = torch.zeros(S, self.span, *shape, dtype=dtype, device=device)  # [S, span, L, 2, Hkv, D]
        for i, cache in enumerate(caches):
            data = cache.filled()
            if data is None:
                continue
            if data.shape[1:] != shape or data.dtype != dtype:
                raise ValueError(
                    f"KVCache {i}: entries {tuple(data.shape[1:])} {data.dtype}, this model needs {shape} {dtype}"
                )
            self.grid[i, : data.shape[0]] = data
        self.plan = None
        self.default_mask = None
        self.plan_flag = ops.enabled()
        self.bounds = F.pad(torch.cumsum(lens, 0), (1, 0))
        self.linear: dict[int, list[gated_delta.GatedDeltaState]] = {}  # new states, committed with the keys
        if self.plan_flag:
            q_pos = torch.full((S, self.q_len), -1, dtype=torch.long, device=device)
            q_pos[self.seg, self.local] = positions
            kv_valid = torch.arange(self.span, device=device)[None] < torch.tensor(self.total, device=device)[:, None]
            self.plan = ops.attention_plan(q_pos, kv_valid, self.num_heads, hkv)

    def attend(self, layer, query, key, value, scaling):
        grid = self.grid
        grid[self.seg, self.pos, layer, 0] = key[0].transpose(0, 1).to(grid.dtype)
        grid[self.seg, self.pos, layer, 1] = value[0].transpose(0, 1).to(grid.dtype)
        k_grid = grid[:, :, layer, 0].transpose(1, 2)  # [S, Hkv, span, D]
        v_grid = grid[:, :, layer, 1].transpose(1, 2)
        hq, dim = query.shape[1], query.shape[3]
        if ops.enabled() != self.plan_flag:
            raise RuntimeError("true_on_policy: the consistent flag was switched in the middle of a forward")
        if self.plan is not None:
            q_grid = query.new_zeros(len(self.seq_lens), self.q_len, hq, dim)
            q_grid[self.seg, self.local] = query[0].transpose(0, 1)
            out = ops.attention(q_grid.transpose(1, 2), k_grid, v_grid, None, None, scaling, plan=self.plan)
            return out.transpose(1, 2)[self.seg, self.local][None]
        # flag off: the default path -- ONE batched SDPA over the padded batch (like a serving
        # engine's batched attention: its numerics depend on the batch's shapes)
        S = len(self.seq_lens)
        q_grid = query.new_zeros(S, self.q_len, hq, dim)
        q_grid[self.seg, self.local] = query[0].transpose(0, 1)
        if self.default_mask is None:
            q_pos = torch.zeros(S, self.q_len, dtype=torch.long, device=query.device)  # padding rows see key 0
            q_pos[self.seg, self.local] = self.pos
            self.default_mask = torch.arange(self.span, device=query.device)[None, None] <= q_pos[:, :, None]
        out = F.scaled_dot_product_attention(
            q_grid.transpose(1, 2),
            k_grid.to(query.dtype),
            v_grid.to(query.dtype),
            attn_mask=self.default_mask[:, None],
            scale=scaling,
            enable_gqa=True,
        )
        return out.transpose(1, 2)[self.seg, self.local][None]

    def gated_delta(self, module, projected) -> torch.Tensor:
        """A Gated DeltaNet layer over every request's new tokens, each from its cache's state: [N, Hv * dv].
        Flag on: :func:`gated_delta.gated_delta_net_varlen`; off: transformers' torch code per request."""
        layer = module.layer_idx
        entering = [cache.linear.get(layer) for cache in self.caches]
        if ops.enabled() != self.plan_flag:
            raise RuntimeError("true_on_policy: the consistent flag was switched in the middle of a forward")
        if not self.plan_flag:
            pieces = [_stock_gated_delta(module, *(x[start:end] for x in projected), state)
                      for start, end, state in zip(self.bounds[:-1].tolist(), self.bounds[1:].tolist(), entering)]
            self.linear[layer] = [state for _, state in pieces]
            return torch.cat([y for y, _ in pieces])
        channels, taps = module.conv1d.weight.shape[0], module.conv1d.weight.shape[-1]
        fresh = gated_delta.GatedDeltaState(
            projected[0].new_zeros(1, channels, taps - 1),
            torch.zeros(1, module.num_v_heads, module.head_v_dim, module.head_k_dim, device=projected[0].device))
        states = [fresh if state is None else state for state in entering]
        batched = gated_delta.GatedDeltaState(*(torch.cat(parts) for parts in zip(*states)))
        y, new = gated_delta.gated_delta_net_varlen(*projected, cu_seqlens=self.bounds, state=batched,
                                                    **_gated_delta_weights(module))
        self.linear[layer] = [gated_delta.GatedDeltaState(new.conv[i:i + 1].clone(), new.recurrent[i:i + 1].clone())
                              for i in range(len(self.caches))]
        return y

    def commit(self):
        for i, cache in enumerate(self.caches):
            cache.append(self.grid[i, self.prefix[i] : self.total[i]])
            cache.linear.update({layer: states[i] for layer, states in self.linear.items()})


@torch.no_grad()
def forward_packed(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: list[int],
    caches: list[KVCache] | None = None,
    logits_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged continuous-batching forward of several requests through the SAME HF model modules.

    ``input_ids``/``positions`` [N]: the new tokens of all requests concatenated; segment i has
    ``seq_lens[i]`` tokens at absolute positions ``caches[i].length ... + seq_lens[i] - 1``.
    With caches, segment i's keys/values are appended to ``caches[i]`` (only if the call succeeds)
    and its queries attend causally to everything in it; with the flag off the attention is one
    batched SDPA over the padded batch (a serving engine's default). Without caches each segment
    is an independent sequence at positions ``0 ... seq_lens[i] - 1`` and the call IS the training
    forward: ``model(input_ids=[1, N], position_ids=[1, N])``, the packed layout of verl's FSDP
    engine (use_remove_padding=True), so with the flag off it shows the trainer's numerics.
    Returns logits [N or len(logits_rows), V] (fp32 when the flag is on). The model's attention
    implementation is set to ``"consistent"`` if it is not (it is what carries the caches).
    """
    if not is_patched():
        raise RuntimeError("forward_packed: call consistent_model.patch_transformers() first")
    input_ids = input_ids.reshape(-1)
    positions = positions.reshape(-1).to(device=input_ids.device, dtype=torch.long)
    seq_lens = [int(n) for n in seq_lens]
    if positions.numel() != input_ids.numel() or sum(seq_lens) != input_ids.numel() or min(seq_lens, default=0) < 1:
        raise ValueError(
            f"forward_packed: {input_ids.numel()} tokens, {positions.numel()} positions and "
            f"seq_lens {seq_lens} do not agree"
        )
    if caches is not None and len(caches) != len(seq_lens):
        raise ValueError(f"forward_packed: {len(caches)} caches for {len(seq_lens)} segments")
    config = model.config
    if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    inputs = dict(
        input_ids=input_ids[None],
        position_ids=positions[None],
        attention_mask=None,
        use_cache=False,
        logits_to_keep=logits_rows if logits_rows is not None else 0,
    )
    if caches is None:
        lens = torch.tensor(seq_lens, device=positions.device)
        starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        if not torch.equal(positions, torch.arange(positions.numel(), device=positions.device) - starts):
            raise ValueError("forward_packed: without caches, segment i's positions must be arange(seq_lens[i])")
        return model(**inputs).logits[0]
    dtype = model.get_input_embeddings().weight.dtype
    batch = _RolloutBatch(positions, seq_lens, caches, config, dtype)
    if not torch.equal(positions, batch.expected):
        raise ValueError("forward_packed: segment i's positions must be cache_length_i + arange(seq_lens[i])")
    out = model(**inputs, **{ROLLOUT_KWARG: batch})
    batch.commit()
    return out.logits[0]
