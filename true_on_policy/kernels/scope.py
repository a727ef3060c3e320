"""The consistent kernels' scope as plain values, torch-free: the contract reads them without importing torch.

The dtypes the kernels compute in, the largest tensor-parallel size whose bits they keep, and how
the contract names the CPU backend's collectives (:mod:`.tensor_parallel`, :mod:`.row_parallel`).
One home each: :mod:`.ops`, :mod:`.tensor_parallel` and the contract read them from here.
"""

from __future__ import annotations

__all__ = ["KERNEL_DTYPES", "MAX_TP", "ROW_PARALLEL_REDUCTION", "MOE_DISPATCH"]

KERNEL_DTYPES = ("float32", "bfloat16")  # what the project's kernels compute in, by torch's name
MAX_TP = 8  # the largest tensor-parallel size a row-parallel linear keeps its bits at (any power of two up to it)
ROW_PARALLEL_REDUCTION = "all_gather+tree_top"  # each rank's fp32 subtree all-gathered, the tree's top folded
MOE_DISPATCH = "replicated"  # EP on CPU: tokens are already on every rank; no dispatch, slot rows selected by owner
