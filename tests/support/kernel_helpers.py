"""Helpers shared by the kernel-level tests (consistent ops, consistent model, diagnosis)."""

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ports import free_port
from true_on_policy.transformers_adapter.forwards import patch_transformers

from true_on_policy.kernels import native, ops, premises
from true_on_policy.kernels.ops import linear_tree, tiling


def gen(seed: int) -> torch.Generator:
    """A fresh CPU generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


@contextlib.contextmanager
def threads(n: int):
    """Run the block with ``n`` intra-op threads (thread count must not change any result bit)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def premise_skip(name: str, detail: str) -> None:
    """Skip the test: premise ``name`` (of :data:`premises.PREMISES`) does not hold on this CPU, said with its
    key, the premise's statement and ``detail`` (what was tried)."""
    if name not in premises.PREMISES:
        raise ValueError(f"premise_skip: premise={name!r} is not one of {sorted(premises.PREMISES)}")
    pytest.skip(f"premise {name} does not hold on this CPU ({premises.key()}): {premises.PREMISES[name]} -- {detail}")


def _chain_tiles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`ops.matmul_tiles` with each K chunk's bmm the library's fma chain (the project's order, no BLAS)."""
    lib = native.lib()
    groups, rows, k = a.shape
    out = None
    for start in range(0, k, tiling.K_CHUNK):
        a_s, b_s = a[..., start : start + tiling.K_CHUNK], b[:, start : start + tiling.K_CHUNK]
        if b.stride(0) == 0:  # the linear's W^T, one for every tile: rows are independent, one call
            part = lib.chain_matmul(a_s.reshape(groups * rows, -1), b_s[0]).view(groups, rows, -1)
        else:
            part = torch.stack([lib.chain_matmul(a_s[g].contiguous(), b_s[g].contiguous()) for g in range(groups)])
        out = part if out is None else out + part
    return out


@contextlib.contextmanager
def own_order():
    """The ops' torch code with the linear's products in the project's own order: each K chunk of each tile the
    library's fma chain (``chain_matmul``), every other step as the torch code. Its linear bits are what the
    native linear's chain and dot routes compute on any CPU; the torch code's equal them where MKL's sgemm is
    that chain (premise ``mkl_sgemm_chain``)."""
    if native.lib() is None:
        raise RuntimeError("own_order: the native library is not built (python -m true_on_policy build-native)")
    saved = linear_tree.matmul_tiles
    linear_tree.matmul_tiles = _chain_tiles
    try:
        with ops.switched(native=False):
            yield
    finally:
        linear_tree.matmul_tiles = saved


def _rank_main(rank: int, world: int, port: int, out_dir: str, worker) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(worker(rank), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker, world: int, out_dir: Path) -> list:
    """``worker(rank)`` on ``world`` spawned processes, each in a gloo group on 127.0.0.1 (one intra-op
    thread): the ranks' return values, in rank order (saved under ``out_dir``)."""
    port = free_port()
    mp.spawn(_rank_main, args=(world, port, str(out_dir), worker), nprocs=world, join=True)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", autouse=True)
def patched_transformers():
    """transformers' Qwen3 classes on the project's module code; the flag restored afterwards."""
    with ops.consistent(ops.enabled()):
        patch_transformers()
        yield
