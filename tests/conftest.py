"""Test isolation for the whole suite."""

import os

import pytest


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test gets back the environment it started with, new keys removed too: the launch exports
    the determinism plan into ``os.environ`` (e.g. ``VLLM_BATCH_INVARIANT=1`` for a CUDA/Ascend plan),
    and a leaked key would reach every later subprocess (vLLM engines, verl runs) of the suite."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
