"""Causal attention as an online softmax over fixed KV blocks aligned at absolute positions.

:func:`attention` (training and prefill, with its backward) and :func:`paged_attention` (a paged cache,
inference) compute a query row from its own q, position and visible keys alone: tiles of query rows against
:data:`.tiling.KV_BLOCK` keys, one block order for a whole sequence and a single decode query, invisible
keys selected away. :class:`AttentionPlan` is the layout part, built once per forward for every layer.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from true_on_policy.kernels.ops import tiling
from true_on_policy.kernels.ops.dispatch import NO_FAULT, Fault, _no_autocast, _route, switches
from true_on_policy.kernels.ops.tiling import matmul_tiles

class AttentionPlan:
    """Everything :func:`attention` derives from the layout alone (positions, valid slots, heads).

    Build it once per forward with :func:`attention_plan` and pass it to every layer's call; it
    holds the query tiles' positions, the (tile, block) pairs to compute and their visibility mask.
    """

    def __init__(self, q_positions: torch.Tensor, kv_valid: torch.Tensor, num_heads: int, num_kv_heads: int):
        if num_heads % num_kv_heads:
            raise ValueError(f"attention: {num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
        device = q_positions.device
        S, Tq = q_positions.shape
        Tk = kv_valid.shape[1]
        rep = num_heads // num_kv_heads
        rows = Tq * rep
        # the plan fixes the tile and block sizes of every call using it. A single tile (decode, short
        # prefill) is as short as its rows allow (see tile_rows) while both of its products -- scores
        # (K = head dim >= 1, N = KV_BLOCK) and PV (K = KV_BLOCK, N = head dim + 1) -- stay on the BLAS path.
        R = tiling.ATTN_TILE_ROWS
        if rows < tiling.ATTN_TILE_ROWS and device.type == "cpu":
            R = next(r for r in tiling.SHORT_TILE_ROWS if rows <= r and r * tiling.KV_BLOCK >= tiling.BLAS_MIN_WORK)
        self.R, self.B = R, B = R, tiling.KV_BLOCK
        n_blocks = max(-(-Tk // B), 1)
        if n_blocks * B != Tk:
            kv_valid = F.pad(kv_valid, (0, n_blocks * B - Tk), value=False)
        tiles = -(-rows // R)
        # query rows of one kv head: position-major, the group's `rep` heads interleaved, tiles of R
        rpos = q_positions[:, :, None].expand(S, Tq, rep).reshape(S, rows)
        if tiles * R != rows:
            rpos = F.pad(rpos, (0, tiles * R - rows), value=-1)
        rpos = rpos.view(S, tiles, R)
        # Elementwise work only on rows that can be real: a single tile (decode) holds `rows` of R.
        # Rows are independent in every elementwise op, so this changes no bit of a real row.
        live = rows if tiles == 1 else R
        rpos = rpos[:, :, :live]
        # (tile, block) pairs to compute: block j is skipped for a tile whose rows all lie before
        # it -- an exact no-op for those rows (see attention()), so skipping changes no bit.
        tile_hi = rpos.amax(dim=(0, 2))
        top = int(tile_hi.max())
        n_used = min(n_blocks, top // B + 1) if top >= 0 else 1
        needed = torch.arange(n_used, device=device)[None, :] * B <= tile_hi[:, None]
        self.dense = bool(needed.all())  # every tile needs every block (decode, short prefill)
        pair_t, pair_j = torch.nonzero(needed, as_tuple=True)
        key_pos = torch.arange(n_blocks * B, device=device).view(n_blocks, B)
        valid_blocks = kv_valid.view(S, n_blocks, B)
        # [S, pairs, live, B]: key visible to the row iff it holds a token at or before the row's position
        self.visible = (key_pos[pair_j][None, :, None, :] <= rpos[:, pair_t, :, None]) & valid_blocks[
            :, pair_j, None, :
        ]
        self.invisible = ~self.visible  # built once per plan, shared by every layer's call
        self.kv_valid = kv_valid
        self.kv_invalid = ~kv_valid
        self.pair_t, self.pair_j = pair_t, pair_j
        self.dims = (S, num_heads, Tq, num_kv_heads, Tk, rep, rows, tiles, live, n_blocks, n_used)


def attention_plan(
    q_positions: torch.Tensor, kv_valid: torch.Tensor, num_heads: int, num_kv_heads: int
) -> AttentionPlan:
    """The layout part of :func:`attention` for ``q_positions`` [S, Tq] and ``kv_valid`` [S, Tk]."""
    return AttentionPlan(q_positions, kv_valid, num_heads, num_kv_heads)


def _tiles_to_heads(x, plan: AttentionPlan):
    """[S, Hkv, tiles, live, D] query rows -> [S, Hq, Tq, D]."""
    S, Hq, Tq, Hkv, _, rep, rows, _, _, _, _ = plan.dims
    D = x.shape[-1]
    x = x.reshape(S, Hkv, -1, D)[:, :, :rows].reshape(S, Hkv, Tq, rep, D).transpose(2, 3)
    return x.reshape(S, Hq, Tq, D)


def _heads_to_tiles(x, plan: AttentionPlan, rows_per_tile: int):
    """[S, Hq, Tq, D] -> [S, Hkv, tiles, rows_per_tile, D] (zero rows appended), fp32."""
    S, Hq, Tq, Hkv, _, rep, rows, tiles, _, _, _ = plan.dims
    D = x.shape[-1]
    x = x.to(torch.float32).view(S, Hkv, rep, Tq, D).transpose(2, 3).reshape(S, Hkv, rows, D)
    if tiles * plan.R != rows:
        x = F.pad(x, (0, 0, 0, tiles * plan.R - rows))
    return x.view(S, Hkv, tiles, plan.R, D)[:, :, :, :rows_per_tile]


def _scatter_pairs(values, plan: AttentionPlan, fill: float):
    """[S, Hkv, pairs, ...] -> [S, Hkv, tiles, n_used, ...] with ``fill`` where a pair was skipped."""
    S, _, _, Hkv, _, _, _, tiles, _, _, n_used = plan.dims
    if plan.dense:
        return values.view(S, Hkv, tiles, n_used, *values.shape[3:])
    out = values.new_full((S, Hkv, tiles, n_used, *values.shape[3:]), fill)
    out[:, :, plan.pair_t, plan.pair_j] = values
    return out


def _identity(x):
    return x


def _key_value_blocks(k, v, plan: AttentionPlan, fault: Fault):
    """Keys as [S, Hkv, block, D, B]; values as [S, Hkv, block, B, D + 1] with invisible slots zeroed
    (0 * NaN would leak) and a ones column appended, so the PV product also accumulates the softmax
    denominator l. Both fp32, zero-padded to whole blocks."""
    S, _, _, Hkv, Tk, _, _, _, _, n_blocks, _ = plan.dims
    D, B = k.shape[-1], plan.B
    if n_blocks * B != Tk:
        k, v = F.pad(k, (0, 0, 0, n_blocks * B - Tk)), F.pad(v, (0, 0, 0, n_blocks * B - Tk))
    if fault.kv_garbage:
        slot_ok = plan.kv_valid[:, None, :, None]
        k, v = torch.where(slot_ok, k, math.nan), torch.where(slot_ok, v, math.nan)
    # (In-place writes into fresh buffers below compute the very same elementwise values as
    # out-of-place ops; they only save allocations, which dominate on CPU.)
    k_blocks = k.to(torch.float32).unflatten(2, (n_blocks, B)).transpose(-1, -2)  # a view
    if not plan.dense:  # gathered per pair: from a contiguous copy, the same values, faster
        k_blocks = k_blocks.contiguous()
    v_ext = v.new_empty(S, Hkv, n_blocks * B, D + 1, dtype=torch.float32)
    v_ext[..., :D] = v
    if not fault.additive_mask:  # (the additive-mask fault keeps them: it adds -1e9 instead of selecting)
        v_ext[..., :D].masked_fill_(plan.kv_invalid[:, None, :, None], 0.0)  # == where(valid, v, 0)
    v_ext[..., D] = 1.0
    return k_blocks, v_ext.view(S, Hkv, n_blocks, B, D + 1)


def _native_attention(attention_kernel, q, k, v, plan: AttentionPlan, scaling: float, keep_for_backward: bool):
    """:func:`_attention_kernel` (no faults) as one call into the fused C++ attention; the same bits.

    The backward state holds q, k, v themselves: the fused backward builds its tiles and blocks from
    them, and the torch backward (:func:`_torch_backward_operands`) only if it runs."""
    S, Hq, Tq, Hkv, Tk, rep, rows, tiles, live, n_blocks, n_used = plan.dims
    args = (q, k, v, scaling, plan.R, plan.B, tiles, live, n_used, plan.pair_t, plan.pair_j, plan.invisible)
    if not keep_for_backward:
        return attention_kernel(*args, plan.kv_invalid, tiling.K_CHUNK, False, None)[0], None
    out, probs, out_tiles = attention_kernel(*args, plan.kv_invalid, tiling.K_CHUNK, True, None)
    probs = probs.view(S, Hkv, plan.pair_t.numel(), live, plan.B)
    return out.to(q.dtype), dict(q=q, k=k, v=v, scaling=scaling, probs=probs, out_tiles=out_tiles)


def _attention_forward(q, k, v, plan: AttentionPlan, scaling: float, keep_for_backward: bool = False):
    """The forward of :func:`attention`: (out [S, Hq, Tq, D] in q's dtype, saved state or None), from the
    implementation :data:`ROUTES` picks. Reads the :class:`Fault` switches (all off outside fault injection)."""
    fault = switches().fault
    if fault != NO_FAULT and keep_for_backward:
        raise RuntimeError(f"attention fault switches are forward-only (diagnosis), got {fault}")
    if (kernel := _route("attention", q.device, q)).run:
        return _native_attention(kernel.run, q, k, v, plan, scaling, keep_for_backward)
    return _attention_kernel(q, k, v, plan, scaling, fault, keep_for_backward)


def _rounding(fault: Fault):
    """The softmax's intermediate values as the fault holds them: in its dtype (in place: p shares its buffer
    with the GEMM operand), else as they are."""
    if fault.softmax_dtype is None:
        return _identity
    return lambda x: x.copy_(x.to(fault.softmax_dtype))


def _attention_kernel(q, k, v, plan: AttentionPlan, scaling: float, fault: Fault, keep_for_backward: bool):
    """:func:`_attention_forward`'s torch code: the specification, with ``fault``'s switches."""
    additive, rounded = fault.additive_mask, _rounding(fault)
    S, Hq, Tq, Hkv, Tk, rep, rows, tiles, live, n_blocks, n_used = plan.dims
    D = q.shape[-1]
    R, B = plan.R, plan.B
    pair_t, pair_j = plan.pair_t, plan.pair_j
    n_pairs = pair_t.numel()
    k_blocks, v_blocks = _key_value_blocks(k, v, plan, fault)

    def flat(x):  # [S, Hkv, pairs, a, b] -> [S * Hkv * pairs, a, b]
        return x.reshape(S * Hkv * n_pairs, *x.shape[-2:])

    def pairs_of_tiles(x):  # [S, Hkv, tiles, ...] -> [S, Hkv, pairs, ...]
        if plan.dense:
            return x[:, :, :, None].expand(S, Hkv, tiles, n_used, *x.shape[3:])
        return x.index_select(2, pair_t)

    def pairs_of_blocks(x):  # [S, Hkv, blocks, ...] -> [S, Hkv, pairs, ...]
        if plan.dense:
            return x[:, :, None, :n_used].expand(S, Hkv, tiles, n_used, *x.shape[3:])
        return x.index_select(2, pair_j)

    if plan.dense and tiles == 1 and not keep_for_backward:
        # decode / short prefill: the scores' left operand written directly -- the tile's rows for
        # every block, zero rows after them: the same values (and layout) as the general path
        q_rows = (q.to(torch.float32) * scaling).view(S, Hkv, rep, Tq, D).transpose(2, 3).reshape(S, Hkv, 1, rows, D)
        q_pairs = q_rows.new_zeros(S, Hkv, n_used, R, D)
        q_pairs[:, :, :, :rows] = q_rows
        q_tiles = None
    else:
        q_tiles = _heads_to_tiles(q.to(torch.float32) * scaling, plan, R)
        q_pairs = pairs_of_tiles(q_tiles)

    scores_tiles = matmul_tiles(flat(q_pairs), flat(pairs_of_blocks(k_blocks))).view(S, Hkv, n_pairs, R, B)
    scores = scores_tiles[:, :, :, :live]
    if additive:
        scores.add_(torch.where(plan.visible[:, None], 0.0, -1e9))
    else:
        scores.masked_fill_(plan.invisible[:, None], -math.inf)  # == torch.where(visible, scores, -inf)

    # running max after each block, per row: the same maximum() chain a block loop computes
    m_run = torch.cummax(_scatter_pairs(scores.amax(dim=-1), plan, -math.inf), dim=3).values
    m_ref = torch.where(m_run == -math.inf, 0.0, m_run)
    alpha = torch.exp(m_run[:, :, :, :-1] - m_ref[:, :, :, 1:])  # rescale of acc entering block j >= 1
    m_pairs = m_ref.view(S, Hkv, -1, live) if plan.dense else m_ref[:, :, pair_t, pair_j]
    p = rounded(scores.sub_(m_pairs[..., None]).exp_())  # == torch.exp(scores - m), in the scores' buffer
    # rows >= live of the tiles are padding whose PV rows are dropped; a GEMM row depends only on
    # its own row, so they keep the scores buffer's content instead of being zeroed
    p_tiles = scores_tiles
    pv = matmul_tiles(flat(p_tiles), flat(pairs_of_blocks(v_blocks)))
    pv = rounded(_scatter_pairs(pv.view(S, Hkv, n_pairs, R, D + 1)[:, :, :, :live], plan, 0.0))

    # online-softmax accumulation in block order: acc_j = acc_{j-1} * alpha_j + pv_j
    pv_j, alpha_j = pv.unbind(3), alpha[..., None].unbind(3)
    acc = pv_j[0]
    for j in range(1, n_used):
        acc = rounded(acc * alpha_j[j - 1] + pv_j[j])

    l = acc[..., D:]
    if additive:  # a plain softmax normalisation: nothing selects rows away
        out_tiles = acc[..., :D] / l
    else:
        has_keys = l > 0
        out_tiles = torch.where(has_keys, acc[..., :D] / torch.where(has_keys, l, 1.0), 0.0)
    out = _tiles_to_heads(out_tiles, plan).to(q.dtype)
    if not keep_for_backward:
        return out, None
    lse = m_run[:, :, :, -1] + torch.log(l[..., 0])  # -inf for rows without keys
    lse = torch.where(torch.isfinite(lse), lse, 0.0)
    # final probabilities of the computed pairs: p_j * exp(m_j - lse) (backward only; p is dead)
    probs = p.mul_(torch.exp(m_pairs - lse[:, :, pair_t])[..., None])
    state = dict(q_tiles=q_tiles, k_blocks=k_blocks, v_blocks=v_blocks, probs=probs, out_tiles=out_tiles)
    return out, state


def _torch_backward_operands(state, plan: AttentionPlan):
    """(q_tiles, k_blocks, v_blocks) of the torch backward: saved by the torch forward, or built from the
    native forward's q, k, v with the very functions the torch forward uses."""
    if "q_tiles" not in state:
        q, k, v = state["q"], state["k"], state["v"]
        k_blocks, v_blocks = _key_value_blocks(k, v, plan, NO_FAULT)
        q_tiles = _heads_to_tiles(q.to(torch.float32) * state["scaling"], plan, plan.R)
        state.update(q_tiles=q_tiles, k_blocks=k_blocks, v_blocks=v_blocks)
    return state["q_tiles"], state["k_blocks"], state["v_blocks"]


# Pairs per step of the torch backward: its per-pair operands ([pairs, B, D] gathered keys, values and
# products) exist for one step at a time, so its memory grows with the sequence, not with the pairs.
BACKWARD_PAIRS = 256


def _pairs(x, index):
    """``x.index_select(2, index)``: the same values and layout (contiguous); copied by advanced indexing,
    which on CPU is many times faster than index_select for some of these operands."""
    return x[:, :, index].contiguous()


def _torch_backward(do, delta, probs, q_tiles, k_blocks, v_blocks, plan: AttentionPlan, step: int = BACKWARD_PAIRS):
    """_Attention.backward's torch code: (grad_q [S, Hkv, tiles, live, D], grad_k, grad_v [S, Hkv, n_blocks, B, D]).

    Per pair p (tile t, block j): grad_s = (do_t @ v_j^T - delta_t) * probs_p; grad_v_j += probs_p^T @ do_t;
    grad_q_t += grad_s @ k_j^T; grad_k_j += grad_s^T @ q_t, the sums in pair order (index_add_). Pairs go
    ``step`` at a time: each pair's products are per-pair bmm entries with the same operand layouts
    whatever the step, and each sum keeps its pair order, so any step gives the same bits (a step of
    all ``P`` pairs is the backward this replaced, whose memory grew with the pairs: quadratic in T)."""
    S, _, _, Hkv, _, _, _, tiles, live, n_blocks, _ = plan.dims
    D, B = do.shape[-1], plan.B
    grad_q = do.new_zeros(S, Hkv, tiles, live, D)
    grad_k, grad_v = do.new_zeros(S, Hkv, n_blocks, B, D), do.new_zeros(S, Hkv, n_blocks, B, D)
    q_rows = q_tiles[:, :, :, :live]
    for lo in range(0, plan.pair_t.numel(), step):
        pair_t, pair_j = plan.pair_t[lo : lo + step], plan.pair_j[lo : lo + step]
        probs_p = probs[:, :, lo : lo + step].contiguous()  # the layout the whole-P step has
        do_p = _pairs(do, pair_t)
        v_p = _pairs(v_blocks, pair_j)[..., :D]
        # == probs * (dP - delta), in dP's buffer (IEEE products commute)
        grad_s = (do_p @ v_p.transpose(-1, -2)).sub_(delta[:, :, pair_t][..., None]).mul_(probs_p)
        grad_v.index_add_(2, pair_j, probs_p.transpose(-1, -2) @ do_p)
        del v_p, do_p, probs_p
        grad_q.index_add_(2, pair_t, grad_s @ _pairs(k_blocks, pair_j).transpose(-1, -2))
        grad_k.index_add_(2, pair_j, grad_s.transpose(-1, -2) @ _pairs(q_rows, pair_t))
    return grad_q, grad_k, grad_v


class _Attention(torch.autograd.Function):
    """Forward: the consistent kernel. Backward: the same (tile, block) pairs with plain bmm and
    index_add (gradients need not be batch-invariant)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scaling):
        out, state = _attention_forward(q, k, v, plan, scaling, keep_for_backward=True)
        ctx.state, ctx.plan, ctx.scaling, ctx.dtypes = state, plan, scaling, (q.dtype, k.dtype, v.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        st, plan = ctx.state, ctx.plan
        live, n_blocks = plan.dims[8], plan.dims[9]
        with _no_autocast(grad_out.device):
            do = _heads_to_tiles(grad_out, plan, live)
            delta = (do * st["out_tiles"]).sum(-1)  # [S, Hkv, tiles, live]
            probs = st["probs"]  # [S, Hkv, P, live, B]
            # the same bits, fused in C++ (after the native forward, whose state holds q, k, v)
            if "q" in st and (kernel := _route("attention_backward", grad_out.device, grad_out, plan)).run:
                grad_q, grad_k, grad_v = kernel.run(
                    do, delta, probs, st["q"], st["k"], st["v"], st["scaling"], plan.R, plan.pair_t, plan.pair_j,
                    plan.kv_invalid, n_blocks,
                )
                return _Attention.finish(ctx, grad_q, grad_k, grad_v)
            grad_q, grad_k, grad_v = _torch_backward(do, delta, probs, *_torch_backward_operands(st, plan), plan)
        return _Attention.finish(ctx, grad_q, grad_k, grad_v)

    @staticmethod
    def finish(ctx, grad_q, grad_k, grad_v):
        """Tiles and blocks back to q, k, v's layouts and dtypes (invalid slots' values get no gradient)."""
        plan = ctx.plan
        S, Hq, Tq, Hkv, Tk, rep, rows, tiles, live, n_blocks, n_used = plan.dims
        D = grad_q.shape[-1]
        with _no_autocast(grad_q.device):
            grad_q = _tiles_to_heads(grad_q * ctx.scaling, plan)
            grad_k = grad_k.view(S, Hkv, n_blocks * plan.B, D)[:, :, :Tk]
            grad_v = grad_v.view(S, Hkv, n_blocks * plan.B, D)
            grad_v = torch.where(plan.kv_valid[:, None, :, None], grad_v, 0.0)[:, :, :Tk]
        ctx.state = None
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        return grad_q.to(q_dtype), grad_k.to(k_dtype), grad_v.to(v_dtype), None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor | None,
    kv_valid: torch.Tensor | None,
    scaling: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention as an online softmax over fixed KV blocks aligned at absolute positions.

    Args: ``q`` [S, Hq, Tq, D]; ``k``, ``v`` [S, Hkv, Tk, D] where the key index IS the absolute
    position; ``q_positions`` [S, Tq] absolute positions of the queries (-1 marks a padding row,
    whose output is 0); ``kv_valid`` [S, Tk] which key slots hold a real token; ``scaling`` the
    softmax scale; ``plan`` optionally :func:`attention_plan` of the same layout, built once and
    shared by all layers (then ``q_positions``/``kv_valid`` are not read). Key j is visible to a
    query at position p iff ``kv_valid[j] and j <= p``. Returns [S, Hq, Tq, D] in ``q``'s dtype.

    Invariant: a query row's result depends only on its own q, position and visible keys. Its
    scores and PV products are :func:`matmul_tiles` over tiles of :data:`ATTN_TILE_ROWS` rows (a
    single tile as short as :func:`tile_rows` allows)
    against one KV block of :data:`KV_BLOCK` keys (fp32); the running max, the rescale factors
    and the accumulator ``acc_j = acc_{j-1} * alpha_j + pv_j`` follow blocks 0, 1, 2, ... with the
    same fp32 ops for a whole sequence (training, prefill) and a single decode query. Invisible
    keys are selected away (score -inf, value 0), so garbage in masked slots never leaks, and a
    block with no visible key is an exact no-op for a row (``m`` unchanged, ``acc * 1 + 0``) --
    which is why a tile whose rows all precede a block may skip it. Backward (training) reuses
    the forward's (tile, block) pairs with plain ops.
    Bits: rest on mkl_sgemm (the products; the native route's are the project's fma chains), vml_exp
    and vml_log; its backward's products on mkl_sgemm (the native backward's: the project's fma chains).
    """
    if plan is None:
        plan = AttentionPlan(q_positions, kv_valid, q.shape[1], k.shape[1])
    S, Hq, Tq, Hkv, Tk, *_ = plan.dims
    if q.shape[:3] != (S, Hq, Tq) or k.shape[:3] != (S, Hkv, Tk) or v.shape[:3] != (S, Hkv, Tk):
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the plan")
    with _no_autocast(q.device):
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _Attention.apply(q, k, v, plan, scaling)
        return _attention_forward(q, k, v, plan, scaling)[0]


@dataclasses.dataclass(frozen=True)
class PagedKV:
    """Keys and values in a paged cache (vLLM's): slot ``t`` of sequence ``s`` is row
    ``(block_table[s, t // bs], :, t % bs)`` of ``key_cache`` / ``value_cache`` [blocks, Hkv, bs, D]."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [S, n_blocks] int

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as :func:`attention` takes them: [S, Hkv, n_blocks * bs, D], a copy."""
        S, n_blocks = self.block_table.shape
        _, hkv, bs, d = self.key_cache.shape
        table = self.block_table.long()
        return tuple(cache[table].permute(0, 2, 1, 3, 4).reshape(S, hkv, n_blocks * bs, d)
                     for cache in (self.key_cache, self.value_cache))

    def slot_rows(self) -> torch.Tensor:
        """[S, n_blocks * bs] int64: each slot's row as an element offset into either cache."""
        bs = self.key_cache.shape[2]
        offsets = torch.arange(bs, device=self.block_table.device) * self.key_cache.stride(2)
        rows = self.block_table.long()[:, :, None] * self.key_cache.stride(0) + offsets
        return rows.reshape(self.block_table.shape[0], -1)


def paged_attention(q: torch.Tensor, kv: PagedKV, plan: AttentionPlan, scaling: float) -> torch.Tensor:
    """:func:`attention` (inference) on keys and values in a paged cache: bitwise ``attention(q,
    *kv.gather(), ..., plan=plan)``. On CPU the native kernel reads the cache in place.

    Bits: as :func:`attention`'s: mkl_sgemm (the project's fma chains on the native route), vml_exp
    and vml_log."""
    S, Hq, Tq, Hkv, Tk, *_ = plan.dims
    _, hkv, bs, _ = kv.key_cache.shape
    table = tuple(kv.block_table.shape)
    if tuple(q.shape[:3]) != (S, Hq, Tq) or table[0] != S or table[1] * bs != Tk or hkv != Hkv:
        raise ValueError(f"paged_attention: q {tuple(q.shape)}, cache {tuple(kv.key_cache.shape)}, block table "
                         f"{table} do not fit the plan's (S, Hq, Tq, Hkv, Tk) = {(S, Hq, Tq, Hkv, Tk)}")
    if (kernel := _route("paged_attention", q.device, q, kv)).run:
        tiles, live, n_used = plan.dims[7], plan.dims[8], plan.dims[10]
        with _no_autocast(q.device):
            return kernel.run(q, kv.key_cache, kv.value_cache, scaling, plan.R, plan.B, tiles, live, n_used,
                              plan.pair_t, plan.pair_j, plan.invisible, plan.kv_invalid, tiling.K_CHUNK, False,
                              kv.slot_rows())[0]
    keys, values = kv.gather()
    return attention(q, keys, values, None, None, scaling, plan)
