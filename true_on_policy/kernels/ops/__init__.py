"""The consistent kernels: one order-fixed implementation per op, used by both engines.

Every op's result for a row is bitwise independent of the batch size and composition, the row's
position, the sequence position, micro-batching and the thread count, on four rules: visible
tokens by selection, never an additive mask; every reduction in a fixed order (fixed row tiles,
fixed K chunks, a fixed pairwise tree whose leaves depend on the unsharded size, so every TP up to
:data:`MAX_TP` gives the same bits); one online-softmax cadence for training and decode; fp32 at
the sensitive points, outputs cast once. Each op's docstring states its invariant, and in its ``Bits:`` line
what its bits rest on besides the project's order (:data:`SPEC_RESTS_ON`, per route :data:`ROUTES`).

This package holds one module per op family (:mod:`.dispatch` says which lives where, and holds the
one switch and the one table of which implementation computes an op); every name is read here, as
``ops.NAME``. Pure torch; no verl, no transformers import. Details: docs/true_on_policy.md.
"""

from __future__ import annotations

from true_on_policy.kernels.ops.block_attention import (
    AttentionPlan,
    PagedKV,
    attention,
    attention_plan,
    paged_attention,
)
from true_on_policy.kernels.ops.dispatch import (
    DTYPES,
    PROBES,
    ROUTES,
    SPEC_RESTS_ON,
    SPECIFICATION,
    Fault,
    Switches,
    _route,
    bits_rest_on,
    consistent,
    enabled,
    set_switches,
    switched,
    switches,
)
from true_on_policy.kernels.ops.elementwise import fixed_sum, sigmoid, sigmoid_gate, silu, silu_mul
from true_on_policy.kernels.ops.linear_tree import (
    WeightPack,
    _padded_linear_forward,
    k_leaves,
    linear,
    linear_epilogue,
    local_leaves,
    matmul_tree,
    pack_experts,
    pack_weight,
    tree_combine,
)
from true_on_policy.kernels.ops.log_probs import log_softmax, token_log_probs
from true_on_policy.kernels.ops.norms import rms_norm
from true_on_policy.kernels.ops.rope import apply_rope, rope_table, text_positions
from true_on_policy.kernels.ops.tiling import (
    ATTN_TILE_ROWS,
    BLAS_MIN_WORK,
    K_CHUNK,
    KV_BLOCK,
    SHORT_TILE_ROWS,
    TILE_ROWS,
    matmul_tiles,
    tile_rows,
)
from true_on_policy.kernels.scope import MAX_TP

__all__ = [
    "TILE_ROWS",
    "ATTN_TILE_ROWS",
    "SHORT_TILE_ROWS",
    "BLAS_MIN_WORK",
    "tile_rows",
    "K_CHUNK",
    "KV_BLOCK",
    "Switches",
    "switches",
    "set_switches",
    "switched",
    "enabled",
    "consistent",
    "ROUTES",
    "PROBES",
    "SPEC_RESTS_ON",
    "bits_rest_on",
    "fixed_sum",
    "matmul_tiles",
    "matmul_tree",
    "MAX_TP",
    "k_leaves",
    "local_leaves",
    "tree_combine",
    "linear",
    "WeightPack",
    "pack_experts",
    "pack_weight",
    "linear_epilogue",
    "rms_norm",
    "silu",
    "silu_mul",
    "sigmoid",
    "sigmoid_gate",
    "rope_table",
    "text_positions",
    "apply_rope",
    "attention",
    "attention_plan",
    "PagedKV",
    "paged_attention",
    "AttentionPlan",
    "log_softmax",
    "token_log_probs",
    "Fault",
    "DTYPES",
]
# Read through ops too, not in __all__: _route (gated_delta.delta_rule's dispatch, the tests), SPECIFICATION,
# _padded_linear_forward (a test of the narrow linear).
