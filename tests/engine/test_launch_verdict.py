"""``check`` is the launch: one table of configs through ``python -m true_on_policy check`` and through
verl's real launch (``verl.trainer.main_ppo``, up to ``ray.init``), the same exit code and the same text.

Both call :func:`true_on_policy.contract.verdict.decide`. The launch runs every case in one interpreter
(tests/support/launch_cases.py: Hydra's entry from argv, as ``python -m verl.trainer.main_ppo`` runs
it; an accepted case stops at ``ray.init``, which refuses an extra keyword before it starts anything,
so no Ray cluster starts). The one intended difference: a device config on this CPU machine, which
``check`` evaluates as declared and the launch refuses (the last cases).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from check_runs import run_check

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
LAUNCHER = REPO / "tests" / "support" / "launch_cases.py"
sys.path.insert(0, str(LAUNCHER.parent))
from launch_cases import STOP_OVERRIDE  # noqa: E402

pytestmark = pytest.mark.subprocess

A, R, T = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "true_on_policy"

# (config, overrides, exit code, a key the verdict's text names)
CASES = [
    # accepted
    ("cpu_tiny", [], 0, "launch accepted (consistent and verified"),
    ("cpu_tiny", [f"{T}.platform=auto"], 0, "platform=auto detected cpu"),
    ("cpu_tiny_vllm", [], 0, "launch accepted"),
    ("cpu_tiny_grpo_vllm", [], 0, "launch accepted"),  # GRPO, n=4: no FlashREINFORCE invariant applies
    ("cpu_tiny_qwen2_vllm", [], 0, "launch accepted"),
    ("cpu_tiny_llama_vllm", [], 0, "launch accepted"),
    ("cpu_tiny_qwen35_vllm", [], 0, "launch accepted (consistent and verified"),
    ("cpu_tiny_qwen35_moe_vllm", [], 0, "launch accepted (consistent and verified"),
    ("cpu_tiny_qwen35_vllm", [f"{R}.engine_kwargs.vllm.mamba_ssm_cache_dtype=bfloat16"], 2, "[ssm_state_dtype]"),
    # what the vLLM adapter refuses at load, refused before Ray by key (twin: the shipped configs above)
    ("cpu_tiny_qwen35_vllm", [f"{R}.enable_prefix_caching=true"], 2, "[prefix_caching]"),
    ("cpu_tiny_qwen35_moe_vllm", [f"+{R}.engine_kwargs.vllm.mamba_cache_mode=align"], 2, "[mamba_cache_mode]"),
    ("cpu_tiny_qwen35_vllm", [f"+{R}.engine_kwargs.vllm.speculative_config={{method:mtp,num_speculative_tokens:1}}"], 2,
     "[speculative]"),
    ("cpu_tiny_qwen35_moe_vllm", ["actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_rollout=true"],
     2, "[speculative]"),
    ("cpu_tiny_qwen35_vllm", ["actor_rollout_ref.model.mtp.enable=true"], 0, "launch accepted"),  # MTP weights, no drafts
    ("cpu_tiny_qwen35_vllm", [f"{R}.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"], 0,
     "launch accepted (consistent and verified"),  # the Gated DeltaNet's heads split by TP
    ("cpu_tiny_qwen35_moe_vllm", [f"{R}.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"], 0,
     "launch accepted (consistent and verified"),  # the shared expert folded through the row-parallel tree
    ("cpu_tiny_vllm_tp2", [], 0, "launch accepted (consistent and verified"),  # training TP 1, rollout TP 2: the TP-invariant kernels
    ("cpu_tiny_moe_vllm_ep2", [], 0, "launch accepted (consistent and verified"),
    ("cpu_tiny", [f"{R}.n=2", f"{T}.relax_invariants=[single_rollout]"], 0, "launch accepted"),
    ("cpu_tiny", [f"{R}.dtype=bfloat16", f"{T}.allow_contract_mismatch=true"], 0, "contract mismatch allowed"),
    # a FlashREINFORCE invariant broken
    ("cpu_tiny", [f"{R}.n=2"], 2, "[single_rollout] actor_rollout_ref.rollout.n = 2"),
    ("cpu_tiny", [f"{A}.ppo_epochs=2"], 2, "[single_epoch]"),
    ("cpu_tiny", [f"{A}.use_kl_loss=true"], 2, "[no_kl]"),
    ("cpu_tiny", [f"{R}.top_p=0.9"], 2, "[full_support_sampling]"),
    ("cpu_tiny", [f"{A}.loss_agg_mode=token-mean"], 2, "[sample_mean_aggregation]"),
    ("cpu_tiny", ["algorithm.adv_estimator=grpo"], 2, "[adv_estimator]"),
    ("cpu_tiny", [f"~{T}"], 2, "has no true_on_policy: section"),
    ("cpu_tiny_grpo_vllm", [f"{T}.negative_token_fraction=0.5"], 2, "true_on_policy.negative_token_fraction=0.5"),
    # a contract mismatch
    ("cpu_tiny", [f"{R}.dtype=bfloat16"], 2, "[compute_dtype]"),
    ("cpu_tiny", [f"{R}.tensor_model_parallel_size=2"], 2, "[tp]"),
    ("cpu_tiny_vllm", [f"{R}.enforce_eager=false"], 2, "[eager]"),
    ("cpu_tiny_vllm", [f"{R}.enable_sleep_mode=true"], 2, "[sleep_mode]"),
    ("cpu_tiny", ["actor_rollout_ref.model.use_fused_kernels=true"], 2, "[fused_kernels]"),
    ("cpu_tiny", ["actor_rollout_ref.model.lora_rank=8"], 2, "[lora]"),
    ("cpu_tiny_vllm", [f"{R}.quantization=fp8"], 2, "[quantization]"),
    ("cpu_tiny_vllm", [f"{A}.fsdp_config.mixed_precision.param_dtype=fp16", f"{R}.dtype=float16"], 2, "[kernel_dtype]"),
    # the training model's config overridden, the rollout's not (twin: test_e2e_cpu_trainer.py)
    ("cpu_tiny", ["+actor_rollout_ref.model.override_config.rms_norm_eps=0.001"], 2, "training=rms_norm_eps=0.001"),
    ("cpu_tiny_vllm", ["+actor_rollout_ref.model.override_config.rms_norm_eps=0.001",
                       f"+{R}.engine_kwargs.vllm.hf_overrides.rms_norm_eps=0.001"], 0, "launch accepted"),
    ("cpu_tiny_vllm", [f"+{R}.engine_kwargs.vllm.kv_cache_dtype=fp8"], 2, "[kv_cache_dtype]"),
    ("cpu_tiny_vllm", ["actor_rollout_ref.model.override_config.attn_implementation=sdpa"], 2, "training=sdpa"),
    # Ulysses SP: the model code all-to-alls by whole heads, under either key, where the heads split by SP
    # (twins: tests/unit/test_ulysses.py without the all-to-all; the refusals below)
    ("cpu_tiny", ["trainer.n_gpus_per_node=2", f"{A}.fsdp_config.ulysses_sequence_parallel_size=2"], 0,
     "launch accepted (consistent and verified"),
    ("cpu_tiny_qwen35_vllm_tp2", [], 0, "launch accepted (consistent and verified"),  # SP 2 training, TP 2 rollout
    ("cpu_tiny_qwen35_vllm_tp2", [f"{A}.fsdp_config.ulysses_sequence_parallel_size=4", "trainer.n_gpus_per_node=4"], 2,
     "the model's linear_num_key_heads=2 does not divide by ulysses_sequence_parallel_size=4"),
    ("cpu_tiny_qwen35_vllm_tp2", [f"{T}.deterministic=false"], 2,
     "the Gated DeltaNet layers all-to-all on the consistent kernels only"),
    ("cpu_tiny", ["trainer.n_gpus_per_node=8", f"{A}.ulysses_sequence_parallel_size=8"], 2,
     f"the model's num_attention_heads=4 does not divide by ulysses_sequence_parallel_size=8 ({A}.ulysses_sequence"
     "_parallel_size (deprecated)=8"),
    ("cpu_tiny_vllm_tp2", [f"{T}.deterministic=false"], 2, "[tp]"),  # no invariant kernels: TP must match
    ("cpu_tiny_vllm_tp2", [f"{R}.tensor_model_parallel_size=16"], 2, "tensor_parallel_size=16 is not supported"),
    ("cpu_tiny_vllm_tp2", [f"{R}.tensor_model_parallel_size=4"], 2, "num_key_value_heads=2 does not divide"),
    # a bad value
    ("cpu_tiny", [f"{T}.deterministic=maybe"], 2, "true_on_policy.deterministic must be a bool, got 'maybe'"),
    ("cpu_tiny", [f"{T}.platform=tpu"], 2, "true_on_policy.platform must be one of"),
    ("cpu_tiny", [f"{T}.relax_invariants=[no_such]"], 2, "unknown invariant name(s)"),
    ("cpu_tiny", [f"{T}.accept_unverified=[no_such_row]"], 2, "not contract rows"),
    ("qwen3_30b_a3b_ascend", [f"{T}.delta=-1"], 2, "true_on_policy.delta must be a number >= 0"),
    # a platform limit
    ("cpu_tiny", [f"{T}.cpu_tensor_parallel_size=2", f"{R}.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"],
     2, "CPU TP/EP is implemented at library level"),
    ("cpu_tiny", [f"{T}.kernels=engine"], 2, "true_on_policy.kernels='engine' on platform cpu"),
]
# A device config on this CPU machine: check evaluates it as declared, the launch refuses the platform.
DEVICE_CASES = [
    ("qwen3_30b_a3b_ascend", [], 3, "true_on_policy.platform='ascend' but this machine is cpu"),
    ("qwen35_35b_a3b_cuda", [], 3, "true_on_policy.platform='cuda' but this machine is cpu"),
    ("cpu_tiny", [f"{T}.platform=cuda"], None, "true_on_policy.platform='cuda' but this machine is cpu"),
]


def _check(config, overrides):
    code, _, err = run_check(["--config-path", str(CONFIGS), "--config-name", config, *overrides, STOP_OVERRIDE])
    return code, err


@pytest.fixture(scope="module")
def launched():
    """Every case through verl's launch, in one process; {(config, overrides): record}."""
    cases = [[config, overrides] for config, overrides, *_ in CASES + DEVICE_CASES]
    result = subprocess.run(
        [sys.executable, str(LAUNCHER), str(CONFIGS)],
        input=json.dumps(cases), cwd=os.environ.get("TMPDIR", "/tmp"), capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    return {(r["config"], tuple(r["overrides"])): r for r in records}


def test_the_table_covers_each_kind_of_verdict():
    codes = [code for _, _, code, _ in CASES]
    assert len(CASES) + len(DEVICE_CASES) >= 15 and codes.count(0) >= 5 and codes.count(2) >= 15


@pytest.mark.parametrize(("config", "overrides", "code", "named"), CASES, ids=[f"{c}:{' '.join(o)}" for c, o, *_ in CASES])
def test_check_and_the_launch_give_the_same_verdict(launched, config, overrides, code, named):
    check_code, check_text = _check(config, overrides)
    launch = launched[(config, tuple(overrides))]
    assert launch["error"] == "", launch["error"]
    assert check_code == launch["code"] == code, (check_text, launch["stderr"])
    assert named in check_text
    # the same text: the launch prints the verdict first (verl's logs may follow it)
    assert check_text and launch["stderr"].startswith(check_text), (check_text, launch["stderr"])
    assert launch["reached_ray"] is (code == 0)  # refused: nothing was started; accepted: verl went on to ray.init


@pytest.mark.parametrize(("config", "overrides", "check_code", "named"), DEVICE_CASES)
def test_a_device_config_is_checked_as_declared_and_refused_by_a_launch_here(launched, config, overrides, check_code, named):
    code, text = _check(config, overrides)
    assert "evaluated as declared" in text and named not in text
    if check_code is not None:
        assert code == check_code
    launch = launched[(config, tuple(overrides))]
    assert launch["code"] == 2 and named in launch["stderr"] and not launch["reached_ray"]
