"""The vLLM-CPU backend's install step (scripts/install_vllm_cpu.sh, run by `make install`) holds.

Each work-around of the script is checked against its reason: torch kept at the project's pin,
the vision/audio builds vllm-cpu pulls absent (they break `import verl`), and the distribution
name `vllm-cpu` (not `vllm`) with vLLM still finding its CPU platform.
"""

import importlib.metadata as md
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from true_on_policy.contract.stack_versions import VLLM_WINDOW

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install_vllm_cpu.sh"


@pytest.mark.subprocess
def test_vision_audio_builds_removed_and_verl_imports():
    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(name) is None, f"{name} is installed: it breaks `import verl`"
    code = "import verl, vllm; print(vllm.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == md.version("vllm-cpu")


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.subprocess
def test_distribution_name_is_vllm_cpu_and_platform_is_cpu():
    # verl reads importlib.metadata.version("vllm"): under the distribution name vllm-cpu it is missing
    missing = "import importlib.metadata as md\ntry:\n    md.version('vllm'); print('found')\nexcept md.PackageNotFoundError:\n    print('missing')"
    assert _run(missing) == "missing"
    assert _run("from vllm.platforms import current_platform; print(current_platform.device_type)") == "cpu"


@pytest.mark.subprocess
def test_distribution_alias_lets_verl_import_its_vllm_rollout():
    code = (
        "import importlib.metadata as md\n"
        "from true_on_policy.vllm_adapter import distribution_alias\n"
        "assert distribution_alias.install()\n"
        "import verl.third_party.vllm as v\n"
        "from vllm.platforms import current_platform\n"
        "print(md.version('vllm'), v.vllm_version, current_platform.device_type)"
    )
    # the twin is test_distribution_name_is_vllm_cpu_and_platform_is_cpu: without the alias the
    # metadata is missing, and verl.third_party.vllm raises "vllm version None not supported"
    installed = md.version("vllm-cpu")
    assert _run(code) == f"{installed}+cpu {installed}+cpu cpu"


@pytest.mark.subprocess
def test_the_install_script_refuses_a_release_outside_the_window_by_name():
    """Before pip runs, naming the window; its twin, a release of the window, is the install CI itself ran."""
    out = subprocess.run(["bash", str(SCRIPT), sys.executable, "0.32.0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"VLLM=0.32.0 is outside the adapter's window ({' '.join(VLLM_WINDOW)})" in out.stderr
