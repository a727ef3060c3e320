"""The training attention: transformers' attention function ``"consistent"`` (:data:`ATTN_IMPLEMENTATION`).

:func:`attention_function` is what every covered attention module calls: [B, H, T, D] in, [B, T, H, D]
out. Flag on: a packed or padded training batch goes onto a [sequence, absolute position] grid and
through :func:`ops.attention`. Flag off: SDPA with HF's own masking semantics. A call carrying the
rollout's batch (``ROLLOUT_KWARG``) is handed to it. Under Ulysses sequence parallelism (the training
engine's group, :mod:`~true_on_policy.kernels.sequence_parallel`) either path runs on the whole sequence
of the rank's heads, between the two all-to-alls. Refused by name, never a silent fallback: HF
``Cache`` objects; with the flag on also sliding windows, dropout, 4D masks and linears that are not
consistent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from true_on_policy.kernels import architectures, ops, sequence_parallel
from true_on_policy.kernels.architectures import UnsupportedFeatureError
from true_on_policy.kernels.modules import require_consistent_linears
from true_on_policy.transformers_adapter import patches

__all__ = [
    "ATTENTION_ROLES",
    "ATTN_IMPLEMENTATION",
    "ROLLOUT_KWARG",
    "attention_function",
    "attn_implementation",
    "mask_function",
    "sequence_positions",
    "training_layout",
]

ATTN_IMPLEMENTATION = "consistent"
ROLLOUT_KWARG = "true_on_policy_rollout"  # model(..., true_on_policy_rollout=<the rollout's batch>)
ATTENTION_ROLES = ("attention", "gated_attention")  # the patch roles whose modules call attention_function


def attn_implementation() -> str:
    """The ``attn_implementation`` to build models with: ``"consistent"`` (see patch_transformers)."""
    return ATTN_IMPLEMENTATION


_UNSUPPORTED_ATTENTION_KWARGS = ("s_aux", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def mask_function(
    batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs
):
    """transformers mask function ``"consistent"``: HF's 2D boolean padding mask (or None), as is."""
    return attention_mask


def _check_attention_call(module, attention_mask, dropout, sliding_window, kwargs) -> None:
    if not isinstance(module, patches.covered(*ATTENTION_ROLES)):
        architectures.check_config(module.config)  # names the architecture
        raise UnsupportedFeatureError(
            f"true_on_policy: attention module {type(module).__name__} is not covered "
            f"(covered: {[c.__name__ for c in patches.covered(*ATTENTION_ROLES)]})"
        )
    require_consistent_linears(module, ("q_proj", "k_proj", "v_proj", "o_proj"))
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


def training_layout(position_ids, attention_mask, batch: int, length: int, device):
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
        seg, pos, valid = training_layout(position_ids, attention_mask, batch, length, device)
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
    g = sequence_parallel.group()
    if g is not None:
        return _sequence_parallel_attention(g, query, key, value, position_ids, attention_mask, scaling, dropout), None
    return _local_attention(query, key, value, position_ids, attention_mask, scaling, dropout), None


def _local_attention(query, key, value, position_ids, attention_mask, scaling, dropout):
    if ops.enabled():
        return _consistent_training_attention(query, key, value, position_ids, attention_mask, scaling)
    batch, _, length, _ = query.shape
    seg, pos, valid = training_layout(position_ids, attention_mask, batch, length, query.device)
    return _default_training_attention(query, key, value, seg, pos, valid, scaling, dropout)


_POSITIONS_CACHE: list = []  # one entry: (this rank's position ids, their version, the gathered ids)


def sequence_positions(position_ids, g):
    """The whole packed sequence's position ids from this rank's slice (verl's Ulysses slices them with the
    tokens), gathered once per forward and shared by its layers (so is the layout built from them)."""
    if position_ids is None:
        raise UnsupportedFeatureError("true_on_policy: Ulysses sequence parallelism needs position_ids (packed input)")
    if _POSITIONS_CACHE and _POSITIONS_CACHE[0][0] is position_ids and _POSITIONS_CACHE[0][1] == _version(position_ids):
        return _POSITIONS_CACHE[0][2]
    gathered = sequence_parallel.gather_sequence(position_ids, g)
    _POSITIONS_CACHE[:] = [(position_ids, _version(position_ids), gathered)]
    return gathered


def _sequence_parallel_attention(g, query, key, value, position_ids, attention_mask, scaling, dropout):
    """Ulysses: [1, H, n, D] per rank -> the whole sequence of the rank's H / SP heads -> attention -> back.
    KV heads fewer than the ranks are repeated so they split (verl's rule, GQA groups kept)."""
    world = dist.get_world_size(g)
    if attention_mask is not None or query.shape[0] != 1:
        raise UnsupportedFeatureError("true_on_policy: Ulysses sequence parallelism takes one packed row without "
                                      "a padding mask (verl's use_remove_padding=True)")
    kv_heads = key.shape[1]
    if kv_heads % world:
        if world % kv_heads:
            raise UnsupportedFeatureError(f"true_on_policy: num_key_value_heads={kv_heads} and "
                                          f"ulysses_sequence_parallel_size={world} do not divide either way")
        key, value = (t.repeat_interleave(world // kv_heads, dim=1) for t in (key, value))

    def to_heads(t):  # [1, H, n, D] -> [1, H / world, world * n, D]
        _, heads, n, dim = t.shape
        local = sequence_parallel.sequence_to_heads(t[0].transpose(0, 1).reshape(n, heads * dim), g)
        return local.view(world * n, heads // world, dim).transpose(0, 1)[None]

    ids = sequence_positions(position_ids, g)
    out = _local_attention(to_heads(query), to_heads(key), to_heads(value), ids, None, scaling, dropout)
    _, length, heads, dim = out.shape  # [1, world * n, H / world, D]
    tokens = sequence_parallel.heads_to_sequence(out[0].reshape(length, heads * dim), g)
    return tokens.view(1, length // world, heads * world, dim)
