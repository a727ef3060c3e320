"""Helpers shared by the kernel-level tests (consistent ops, consistent model, diagnosis)."""

import contextlib

import pytest
import torch

from true_on_policy.kernels import model as consistent_model

from true_on_policy.kernels import ops as consistent_ops


@contextlib.contextmanager
def threads(n: int):
    """Run the block with ``n`` intra-op threads (thread count must not change any result bit)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module", autouse=True)
def patched_transformers():
    """transformers' Qwen3 classes on the project's module code; the flag restored afterwards."""
    previous = consistent_ops.enabled()
    consistent_model.patch_transformers()
    yield
    consistent_ops.set_enabled(previous)
