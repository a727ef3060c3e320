"""The consistency contract, the determinism environment, the check CLI and the 30B-A3B example.

Everything here runs on CPU: no NPU/GPU library is installed or imported; the Ascend and CUDA
paths are exercised by feeding versions in and checking what would be set.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from true_on_policy.cli import check as check_cli

from true_on_policy.contract import consistency as contract

from true_on_policy.contract import determinism_plan as determinism_env

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
ASCEND = "qwen3_30b_a3b_ascend"
CUDA = "qwen3_30b_a3b_cuda"
DEVICE_MODULES = ("torch_npu", "vllm", "vllm_ascend")


@pytest.fixture(scope="module")
def ascend_cfg():
    return check_cli.compose_config(str(CONFIGS), ASCEND)


@pytest.fixture(scope="module")
def cuda_cfg():
    return check_cli.compose_config(str(CONFIGS), CUDA)


def _with(cfg, **updates):
    """A copy of ``cfg`` with dotted keys set (added where absent)."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    OmegaConf.set_struct(out, False)
    for key, value in updates.items():
        OmegaConf.update(out, key.replace("__", "."), value, force_add=True)
    return out


def _contract(cfg, detected=None):
    # detected={} : nothing installed here, the config's stack_versions stand in
    return contract.build_contract(cfg, detected={} if detected is None else detected)


def _run_check(argv):
    out, err = io.StringIO(), io.StringIO()
    code = check_cli.main(argv, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


# --------------------------------------------------------------------------------------------
# check CLI
# --------------------------------------------------------------------------------------------


def test_check_ascend_config_is_consistent(ascend_cfg):
    code, out, err = _run_check(["--config-path", str(CONFIGS), "--config-name", ASCEND])
    assert code == 0, err
    assert "true-on-policy contract" in out and "TP (tensor parallel)" in out
    assert "consistent: no mismatch" in out
    assert err == ""


def test_check_reports_rollout_tp_mismatch():
    code, out, err = _run_check(
        ["--config-path", str(CONFIGS), "--config-name", ASCEND, "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
    )
    assert code == 2
    lines = err.strip().splitlines()
    assert lines and all(line for line in lines)
    tp_lines = [line for line in lines if line.startswith("TP (tensor parallel) [tp]")]
    assert len(tp_lines) == 1
    assert "training=4" in tp_lines[0] and "rollout=1" in tp_lines[0]
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=4" in tp_lines[0]  # the fix
    assert "MISMATCH" in out


def test_check_cli_as_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "true_on_policy.cli.check", "--config-path", str(CONFIGS), "--config-name", ASCEND],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "consistent: no mismatch" in proc.stdout


def test_check_subcommand_dispatch_in_process():
    from true_on_policy import __main__ as cli

    code = cli.main(
        ["check", "--config-path", str(CONFIGS), "--config-name", ASCEND, "actor_rollout_ref.rollout.dtype=float16"]
    )
    assert code == 2


def test_check_unreadable_config_exits_1(tmp_path):
    code, _, err = _run_check(["--config-path", str(tmp_path), "--config-name", "missing"])
    assert code == 1 and "cannot compose" in err


def test_cuda_twin_is_consistent(cuda_cfg):
    result = _contract(cuda_cfg)
    assert contract.compare(result) == []
    assert result.row("tp").training.value == result.row("tp").rollout.value == 1
    assert result.row("ep").training.value == result.row("ep").rollout.value == 8
    env = result.row("determinism_env")
    assert env.training.value["NCCL_ALGO"] == env.rollout.value["NCCL_ALGO"] == "allreduce:tree"


# --------------------------------------------------------------------------------------------
# every contract field
# --------------------------------------------------------------------------------------------

R = "actor_rollout_ref.rollout"
MG = "actor_rollout_ref.actor.megatron"

CONFIG_MISMATCHES = [
    ("tp", ASCEND, {f"{R}.tensor_model_parallel_size": 2, f"{R}.expert_parallel_size": 8}),
    ("ep", ASCEND, {f"{MG}.expert_model_parallel_size": 8}),
    ("etp", ASCEND, {f"{MG}.expert_tensor_parallel_size": None}),
    ("pp", ASCEND, {f"{MG}.pipeline_model_parallel_size": 2}),
    ("cp", ASCEND, {f"{MG}.context_parallel_size": 2}),
    ("compute_dtype", ASCEND, {f"{R}.dtype": "float16"}),
    ("attention", ASCEND, {f"{MG}.override_transformer_config.attention_backend": "fused"}),
    ("attention", CUDA, {f"{R}.name": "sglang"}),
    ("row_parallel", ASCEND, {f"{R}.name": "sglang"}),
    ("row_parallel", ASCEND, {f"{MG}.sequence_parallel": False}),  # against the pin
    ("moe_dispatcher", CUDA, {f"{R}.engine_kwargs.vllm.all2all_backend": "deepep_low_latency"}),
    ("moe_dispatcher", CUDA, {"true_on_policy.moe_dispatcher": "alltoall"}),  # against the pin
    ("moe_router_dtype", CUDA, {"true_on_policy.moe_router_dtype": None,
                                f"{MG}.override_transformer_config.moe_router_dtype": "fp64",
                                "actor_rollout_ref.rollout.name": "cpu"}),
    ("logprobs", ASCEND, {f"{R}.logprobs_mode": "raw_logits"}),
    ("logprobs", ASCEND, {f"{R}.calculate_log_probs": False}),
    ("sampling", ASCEND, {f"{R}.top_p": 0.9}),
    ("sampling", ASCEND, {f"{R}.top_k": 20}),
]


@pytest.mark.parametrize(("field", "config_name", "updates"), CONFIG_MISMATCHES)
def test_config_mismatch_is_detected(field, config_name, updates, ascend_cfg, cuda_cfg):
    base = ascend_cfg if config_name == ASCEND else cuda_cfg
    result = _contract(_with(base, **updates))
    found = {m.field: m for m in contract.compare(result)}
    assert field in found, contract.format_table(result)
    m = found[field]
    assert m.fix and m.training_source and m.rollout_source
    assert field in m.line() and "fix:" in m.line()


ROW_MISMATCHES = [
    ("moe_combine", {"training": "expert_major", "rollout": "token_major"}),
    ("batch_invariant", {"training": "off"}),
    ("determinism_env", {"training": {"HCCL_DETERMINISTIC": "true"}}),
    ("kv_block_size", {"rollout": 64}),
    ("moe_router_dtype", {"training": "float32", "rollout": "bfloat16"}),
]


@pytest.mark.parametrize(("field", "changes"), ROW_MISMATCHES)
def test_row_mismatch_is_detected(field, changes, ascend_cfg):
    result = _contract(ascend_cfg)
    assert contract.compare(result) == []
    broken = result.replace_row(field, **changes)
    assert [m.field for m in contract.compare(broken)] == [field]


def test_every_strict_row_is_covered():
    covered = {f for f, _, _ in CONFIG_MISMATCHES} | {f for f, _ in ROW_MISMATCHES}
    info_rows = {"engine", "dp", "param_dtype", "ulysses"}
    strict = {"tp", "ep", "etp", "pp", "cp", "compute_dtype", "attention", "row_parallel", "moe_dispatcher",
              "moe_combine", "moe_router_dtype", "logprobs", "sampling", "batch_invariant", "determinism_env",
              "kv_block_size"}
    assert strict <= covered
    assert not info_rows & covered


def test_info_rows_never_mismatch(ascend_cfg):
    result = _contract(_with(ascend_cfg, **{f"{R}.data_parallel_size": 2, f"{R}.expert_parallel_size": 8,
                                           f"{MG}.expert_model_parallel_size": 8}))
    assert "dp" not in {m.field for m in contract.compare(result)}
    assert result.row("dp").kind == contract.INFO and result.row("param_dtype").kind == contract.INFO


def test_unverified_is_flagged_not_failed(ascend_cfg):
    result = _contract(ascend_cfg)
    assert contract.status(result, result.row("moe_dispatcher")) == "unverified"
    assert contract.status(result, result.row("moe_router_dtype")) == "unverified"
    table = contract.format_table(result)
    assert "unverified" in table and "consistent: no mismatch" in table


def test_determinism_rows_off_when_not_deterministic(ascend_cfg):
    cfg = _with(ascend_cfg, **{"true_on_policy.deterministic": False,
                               f"{MG}.override_transformer_config.attention_backend": "fused"})
    result = _contract(cfg)
    fields = {m.field for m in contract.compare(result)}
    assert "attention" not in fields and "kv_block_size" not in fields
    assert contract.status(result, result.row("attention")) == "off"
    assert result.plan.worker_env == {}


def test_rl_config_missing_on_old_vllm_ascend_is_a_mismatch(ascend_cfg):
    result = _contract(ascend_cfg, detected={"vllm-ascend": "0.24.0rc1", "cann": "9.0.0"})
    fields = {m.field for m in contract.compare(result)}
    assert "attention" in fields  # vllm-ascend picks its own attention without rl_config
    assert any("installed 0.24.0rc1" in n for n in result.notes)


def test_format_table_is_side_by_side(ascend_cfg):
    bad = _contract(_with(ascend_cfg, **{f"{R}.dtype": "float16"}))
    table = contract.format_table(bad, contract.compare(bad))
    header = next(line for line in table.splitlines() if line.startswith("field"))
    assert "training" in header and "rollout" in header and "status" in header
    row = next(line for line in table.splitlines() if line.startswith("compute dtype"))
    assert "bfloat16" in row and "float16" in row and "MISMATCH" in row


def test_contract_module_does_not_import_verl():
    code = "import sys, true_on_policy.contract.consistency, true_on_policy.contract.determinism_plan as d; " \
           "d.plan(True, 'ascend', versions={}); d.plan(True, 'cuda', versions={}); " \
           "print(sorted(m for m in sys.modules if m.split('.')[0] in ('verl','torch','torch_npu','vllm','vllm_ascend')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------
# determinism environment
# --------------------------------------------------------------------------------------------


def _no_vllm(name):
    raise ImportError(name)


@pytest.mark.parametrize("platform", determinism_env.PLATFORMS)
def test_flag_off_sets_nothing(platform):
    p = determinism_env.plan(False, platform, versions={}, importer=_no_vllm)
    assert p.worker_env == {} and p.rollout_config == {} and p.training_config == {} and p.in_process == ()
    assert p.rollout_forced_env == {}


def test_cpu_selects_consistent_kernels_only():
    p = determinism_env.plan(True, "cpu", versions={})
    assert p.worker_env == {} and p.rollout_config == {} and p.in_process == ()
    assert any("consistent kernels" in op for op in p.ops)


def test_ascend_environment():
    p = determinism_env.plan(
        True, "ascend", versions={"vllm-ascend": "0.26.0rc1", "cann": "9.0.0"}, training_strategy="megatron",
        row_parallel=determinism_env.ROW_PARALLEL_RS_AG, moe_router_dtype="fp32", moe_dispatcher="alltoall",
    )
    assert p.worker_env == {
        "HCCL_DETERMINISTIC": "strict",
        "LCCL_DETERMINISTIC": "1",
        "CLOSE_MATMUL_K_SHIFT": "1",
        "ATB_MATMUL_SHUFFLE_K_ENABLE": "0",
        "ATB_LLM_LCOC_ENABLE": "0",
        "VLLM_ASCEND_ENABLE_NZ": "0",
        "VLLM_BATCH_INVARIANT": "1",
        "VLLM_ASCEND_ENABLE_FLASHCOMM1": "1",
    }
    rl = f"{determinism_env.ROLLOUT_VLLM}.additional_config.rl_config"
    assert p.rollout_config == {
        f"{determinism_env.ROLLOUT_VLLM}.block_size": 128,
        f"{rl}.enabled": True,
        f"{rl}.enable_training_consistency": True,
        f"{rl}.enable_batch_invariant": True,
    }
    tc = determinism_env.MEGATRON_TC
    assert p.training_config == {
        f"{tc}.use_flash_attn_npu_batch_invariant": True,
        f"{tc}.moe_router_dtype": "fp32",
        f"{tc}.moe_token_dispatcher_type": "alltoall",
    }
    assert p.in_process == (("torch.use_deterministic_algorithms", {"mode": True, "warn_only": True}),)
    assert p.rollout_forced_env == {"HCCL_DETERMINISTIC": "strict", "LCCL_DETERMINISTIC": "1"}
    assert all(s.source for s in p.settings)
    assert not any("A3" in n for n in p.notes)  # CANN 9.0 preserves order on A3


def test_ascend_without_flashcomm_when_training_all_reduces():
    p = determinism_env.plan(True, "ascend", versions={}, row_parallel=determinism_env.ROW_PARALLEL_ALL_REDUCE)
    assert "VLLM_ASCEND_ENABLE_FLASHCOMM1" not in p.worker_env


@pytest.mark.parametrize(
    ("version", "has_rl_config"),
    [("0.26.0rc1", True), ("0.26.0", True), ("0.27.1rc1", True), ("0.24.0rc1", False), ("0.25.1.dev7+gabc", False),
     ("0.13.0", False), (None, False)],
)
def test_rl_config_only_where_the_installed_vllm_ascend_has_it(version, has_rl_config):
    p = determinism_env.plan(True, "ascend", versions={"vllm-ascend": version})
    emitted = any(".rl_config." in key for key in p.rollout_config)
    assert emitted is has_rl_config
    assert any("rl_config" in s for s in p.skipped) is (not has_rl_config)


@pytest.mark.parametrize(
    ("cann", "hccl", "a3_note"),
    [("8.0.0", "true", True), ("8.2.RC1", "strict", True), ("8.5.0", "strict", True), ("9.0.0", "strict", False),
     (None, "strict", True)],
)
def test_hccl_value_follows_cann(cann, hccl, a3_note):
    p = determinism_env.plan(True, "ascend", versions={"cann": cann})
    assert p.worker_env["HCCL_DETERMINISTIC"] == hccl
    assert any("Atlas A3" in n for n in p.notes) is a3_note


def test_cuda_environment_from_table():
    p = determinism_env.plan(True, "cuda", versions={"nccl": "2.28.9"}, importer=_no_vllm)
    env = p.worker_env
    assert env["VLLM_BATCH_INVARIANT"] == "1"
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert env["NCCL_ALGO"] == "allreduce:tree" and env["NCCL_PROTO"] == "Simple"
    assert env["NCCL_MIN_NCHANNELS"] == env["NCCL_MAX_NCHANNELS"] == "1"
    assert p.rollout_config == {f"{determinism_env.ROLLOUT_VLLM}.attention_backend": "FLASH_ATTN"}
    assert any(s.startswith("NCCL_ALGO=Ring") for s in p.skipped)
    for key in determinism_env.REDUCTION_ENV_KEYS["cuda"]:
        assert p.worker_env[key] == p.rollout_process_env()[key]


def test_cuda_nccl_2_31_reenables_other_collectives():
    p = determinism_env.plan(True, "cuda", versions={"nccl": "2.31.2"}, importer=_no_vllm)
    assert p.worker_env["NCCL_ALGO"] == "ring,tree;allreduce:tree"


def test_cuda_mirrors_the_installed_vllm_and_restores_environ(monkeypatch):
    monkeypatch.delenv("NCCL_ALGO", raising=False)

    def override_envs_for_invariance():
        os.environ["NCCL_ALGO"] = "future:value"
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"

    fake = types.SimpleNamespace(override_envs_for_invariance=override_envs_for_invariance)
    before = dict(os.environ)
    p = determinism_env.plan(True, "cuda", versions={}, importer=lambda name: fake)
    assert dict(os.environ) == before
    assert p.worker_env["NCCL_ALGO"] == p.rollout_forced_env["NCCL_ALGO"] == "future:value"
    assert any("mirrored" in n for n in p.notes)


def test_plans_import_no_device_library():
    for name in DEVICE_MODULES:
        sys.modules.pop(name, None)
    determinism_env.plan(True, "ascend", versions={})
    determinism_env.plan(True, "cuda", versions={}, importer=_no_vllm)
    assert not any(name in sys.modules for name in DEVICE_MODULES)


def test_version_detection_reads_metadata_without_importing():
    installed = {"vllm-ascend": "0.26.0rc1", "vllm": "0.24.0", "torch-npu": "2.10.0.post2"}

    def metadata_version(dist):
        if dist in installed:
            return installed[dist]
        raise __import__("importlib.metadata").metadata.PackageNotFoundError(dist)

    found = determinism_env.detect_versions("ascend", metadata_version=metadata_version, cann_version=lambda: "9.0.0")
    assert found == {"vllm-ascend": "0.26.0rc1", "vllm": "0.24.0", "torch-npu": "2.10.0.post2", "cann": "9.0.0"}
    assert determinism_env.detect_versions("cpu", metadata_version=metadata_version) == {}
    cuda = determinism_env.detect_versions("cuda", metadata_version=metadata_version)
    assert cuda["vllm"] == "0.24.0" and cuda["nccl"] is None


def test_detected_version_wins_over_declared():
    v = determinism_env.resolve_versions(
        "ascend", declared={"vllm-ascend": "0.26.0rc1", "cann": "9.0.0"}, detected={"vllm-ascend": "0.24.0rc1"}
    )
    assert v.effective["vllm-ascend"] == "0.24.0rc1" and v.provenance["vllm-ascend"] == "detected"
    assert v.effective["cann"] == "9.0.0" and v.provenance["cann"] == "declared"
    assert v.conflicts and "0.24.0rc1" in v.conflicts[0]


def test_version_ordering():
    pv = determinism_env.parse_version
    assert pv("8.3.RC1") < pv("8.3.0") < pv("8.5.0") < pv("9.0.0")
    assert pv("0.25.1.dev3+gabc") < pv("0.26.0rc1") < pv("0.26.0")
    assert determinism_env.version_at_least(None, "1.0") is None


def test_launch_overrides_compose_to_the_applied_plan(ascend_cfg):
    p = determinism_env.plan_for_config(ascend_cfg, detected={})
    composed = check_cli.compose_config(str(CONFIGS), ASCEND, determinism_env.hydra_overrides(p))
    applied = determinism_env.apply_to_config(ascend_cfg, p)
    for path, value in determinism_env.config_updates(p).items():
        assert OmegaConf.select(composed, path) == OmegaConf.select(applied, path) == value, path
    env = OmegaConf.to_container(composed.ray_kwargs.ray_init.runtime_env.env_vars)
    assert all(isinstance(v, str) for v in env.values())  # Ray wants string env values


def test_apply_in_process_sets_torch_determinism():
    import torch

    p = determinism_env.plan(True, "cuda", versions={}, importer=_no_vllm)
    try:
        assert determinism_env.apply_in_process(p) == ["torch.use_deterministic_algorithms(True)"]
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # a nondeterministic op raises
    finally:
        torch.use_deterministic_algorithms(False)
    assert determinism_env.apply_in_process(determinism_env.plan(True, "cpu", versions={})) == []


# --------------------------------------------------------------------------------------------
# example script
# --------------------------------------------------------------------------------------------


def test_example_dry_run_prints_config_table_and_command(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PLATFORM": "ascend", "NNODES": "2", "HOME": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(REPO / "examples" / "run_qwen3_30b_a3b.sh"), "--dry-run"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "# resolved config" in out and "tensor_model_parallel_size: 4" in out
    assert "true-on-policy contract" in out and "consistent: no mismatch" in out
    command = out.split("# launch command", 1)[1].strip().splitlines()[0]
    assert "-m verl.trainer.main_ppo" in command
    assert f"--config-path={CONFIGS}" in command and f"--config-name={ASCEND}" in command
    assert "HCCL_DETERMINISTIC" in command and "rl_config.enabled=true" in command
    assert "nnodes: 2" in out
