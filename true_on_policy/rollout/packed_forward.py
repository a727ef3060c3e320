"""The CPU engine's packed forward: several requests as one ragged batch through transformers' model.

:func:`forward_packed` runs the same module code as the trainer
(:mod:`true_on_policy.transformers_adapter.forwards`) over per-request :class:`KVCache` objects: each
request's new tokens at their absolute positions, its keys and values (and Gated DeltaNet states) kept
in its cache. The batch reaches every attention call through ``ROLLOUT_KWARG``
(:mod:`true_on_policy.transformers_adapter.training_attention`). Flag off: one batched SDPA over the
padded batch, a serving engine's default numerics. No verl import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from true_on_policy.kernels import gated_delta, ops
from true_on_policy.transformers_adapter.forwards import gated_delta_weights, is_patched
from true_on_policy.transformers_adapter.training_attention import ATTN_IMPLEMENTATION, ROLLOUT_KWARG

__all__ = ["KVCache", "forward_packed"]


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
                                                    **gated_delta_weights(module))
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
