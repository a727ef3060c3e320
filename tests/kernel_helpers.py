"""Helpers shared by the kernel-level tests (consistent ops, consistent model, diagnosis)."""

import contextlib
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from true_on_policy.kernels.model import patch_transformers

from true_on_policy.kernels.ops import enabled, set_enabled


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a gloo group's rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawn_ranks(worker, world: int, out_dir: Path) -> list:
    """``worker(rank)`` on ``world`` spawned processes, each in a gloo group on 127.0.0.1 (one intra-op
    thread): the ranks' return values, in rank order (saved under ``out_dir``)."""
    port = free_port()
    mp.spawn(_rank_main, args=(world, port, str(out_dir), worker), nprocs=world, join=True)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", autouse=True)
def patched_transformers():
    """transformers' Qwen3 classes on the project's module code; the flag restored afterwards."""
    previous = enabled()
    patch_transformers()
    yield
    set_enabled(previous)
