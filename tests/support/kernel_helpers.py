"""Helpers shared by the kernel-level tests (consistent ops, consistent model, diagnosis)."""

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from support.ports import free_port
from true_on_policy.transformers_adapter.forwards import patch_transformers

from true_on_policy.kernels import ops


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
