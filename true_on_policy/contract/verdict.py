"""The launch verdict: one function that decides whether a composed config may launch.

``python -m true_on_policy check``, the recipe scripts' ``--dry-run`` (which run ``check``) and
verl's launch hook (:mod:`true_on_policy.verl_adapter.launch`) all call :func:`decide` and exit with
its code, printing its text. It runs, in order, on the config as composed:

1. the config, read once (:func:`~true_on_policy.config.launch.read_launch`): the ``true_on_policy:``
   section (:class:`~true_on_policy.config.settings.Settings`), the two sides' views, the invariants'
   keys and the checkpoint's config.json, judged once by
   :func:`~true_on_policy.kernels.architectures.inspect_checkpoint`; everything below works on those;
2. the platform: ``auto`` is detected from the machine, an explicit one must be this machine's
   (``check`` evaluates a device config on another machine as declared and says so);
3. the FlashREINFORCE invariants, when the loss or the estimator is FlashREINFORCE, and the
   FlashREINFORCE-only settings otherwise;
4. the platform's limits (CPU TP/EP is library level only) and, when the project's kernels run,
   what the checkpoint's architecture check refused (:func:`~true_on_policy.kernels.architectures.check_config`);
5. the determinism plan and the consistency contract on the two sides' views;
6. the contract's mismatches (refused unless ``allow_contract_mismatch``) and unverified rows
   (refused unless each is named in ``accept_unverified``).

Exit codes: 0 accepted, 2 refused (a bad value, a broken invariant, a platform mismatch or limit, a
contract mismatch), 3 refused only for unverified rows. Anything else raised is a bug of ours
(``check`` exits 1, the launch reports an internal error). Pure: no verl import.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from true_on_policy.config import invariants
from true_on_policy.config.launch import read_launch
from true_on_policy.config.platform import Machine
from true_on_policy.config.settings import ConfigError, Settings, platform_limits, resolve_platform
from true_on_policy.contract import consistency, determinism_plan
from true_on_policy.contract.stack_versions import resolve_versions

EXIT_OK, EXIT_ERROR, EXIT_REFUSED, EXIT_UNVERIFIED = 0, 1, 2, 3
PREFIX = "true_on_policy: "


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The answer for one composed config: what ``check`` and the launch both print and exit with."""

    code: int
    lines: tuple[str, ...]
    settings: Settings | None = None  # the parsed section, platform resolved
    plan: Any = None  # determinism_plan.Plan
    contract: consistency.Contract | None = None

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "lines": list(self.lines),
            "settings": dataclasses.asdict(self.settings) if self.settings else None,
            "plan": self.plan.as_dict() if self.plan is not None else None,
            "contract": self.contract.as_dict() if self.contract is not None else None,
        }


def decide(
    config: Mapping[str, Any],
    *,
    machine: Machine,
    launching: bool,
    detected: Mapping[str, str | None] | None = None,
    importer: Callable[[str], Any] = importlib.import_module,
) -> Verdict:
    """The verdict for a composed, resolved verl config on ``machine``.

    ``launching``: the launch refuses an explicit platform that is not this machine's; ``check``
    (False) evaluates the declared platform and notes that it was not detected here. ``detected``
    and ``importer`` feed installed versions and vLLM's module to the plan (defaults: this machine).
    """
    try:
        launch = read_launch(config)
    except ConfigError as error:
        return _refused([f"bad config value: {error}"])
    flashreinforce = launch.algorithm.flashreinforce
    if launch.settings is None:
        if flashreinforce:
            return _refused([
                "bad config value: the config trains with FlashREINFORCE (actor_rollout_ref.actor.policy_loss.loss_mode / "
                "algorithm.adv_estimator = flashreinforce) but has no true_on_policy: section; compose "
                "common/true_on_policy (configs/common/true_on_policy.yaml)"
            ])
        return Verdict(EXIT_OK, (PREFIX + "no true_on_policy: section: the launch runs plain verl, nothing is checked",))

    refusals: list[str] = []
    notes: list[str] = []
    settings = resolve_platform(launch.settings, machine, launching, refusals, notes)
    if settings is None:
        return _refused(refusals)
    limits = platform_limits(settings)
    checkpoint = launch.checkpoint
    if settings.consistent_kernels and checkpoint is not None and checkpoint.uncovered:
        # the project's kernels refuse, by name, what they do not cover (a hub name: the engines check it at load)
        limits.append(f"uncovered model: actor_rollout_ref.model.path={launch.sides.training.model_path!r}: {checkpoint.uncovered}")
    refusals += invariants.refusals(launch.algorithm, settings, notes)
    refusals += limits

    plan = contract = None
    try:
        versions = resolve_versions(settings.platform, declared=dict(settings.stack_versions), detected=detected)
        plan = determinism_plan.plan(settings, launch.sides, versions, importer=importer)
        contract = consistency.build_contract(settings, launch.sides, plan, checkpoint=checkpoint)
    except ConfigError as error:
        refusals.append(f"bad config value: {error}")
    if contract is None:
        return _refused(refusals, notes, settings, plan)

    mismatches, unverified = consistency.compare(contract), consistency.unverified(contract)
    if mismatches and not settings.allow_contract_mismatch:
        refusals += [m.line() for m in mismatches]
        refusals.append(
            "training and rollout are not pinned identically, so log-probs cannot match bitwise: fix the config, or "
            "launch anyway with true_on_policy.allow_contract_mismatch=true"
        )
    else:
        notes += [f"contract mismatch allowed by true_on_policy.allow_contract_mismatch: {m.line()}" for m in mismatches]
    open_rows, accepted_lines = _unverified(contract, unverified, settings, refusals)
    notes += accepted_lines
    if refusals:
        return _refused(refusals, notes, settings, plan, contract)
    if open_rows:
        return _refused_unverified(open_rows, notes, settings, plan, contract)
    headline = "consistent and verified" if not mismatches and not accepted_lines else "accepted as configured"
    return Verdict(
        EXIT_OK,
        (PREFIX + f"launch accepted ({headline}; platform {settings.platform}, deterministic={settings.deterministic})", *notes),
        settings,
        plan,
        contract,
    )


def _refused(refusals, notes=(), settings=None, plan=None, contract=None) -> Verdict:
    lines = (PREFIX + "refused (nothing was started):", *refusals, *notes)
    return Verdict(EXIT_REFUSED, lines, settings, plan, contract)


def _refused_unverified(open_rows, notes, settings, plan, contract) -> Verdict:
    names = ",".join(row.field for row, _ in open_rows)
    flags = " ".join(f"--accept-unverified {row.field}" for row, _ in open_rows)
    lines = [
        PREFIX + "refused: contract rows that cannot be verified for this stack (consistent where visible):",
        *(f"UNVERIFIED {row.title} [{row.field}]: {reason}" for row, reason in open_rows),
        f"launch anyway only by naming them: true_on_policy.accept_unverified=[{names}] (check: {flags})",
        *notes,
    ]
    return Verdict(EXIT_UNVERIFIED, tuple(lines), settings, plan, contract)


def _unverified(contract, rows, settings: Settings, refusals: list[str]):
    """(``rows`` still open, lines for the accepted ones); an accepted name that is no row is refused."""
    fields = [row.field for row in contract.rows]
    unknown = sorted(set(settings.accept_unverified) - set(fields))
    if unknown:
        refusals.append(f"bad config value: true_on_policy.accept_unverified={unknown}: not contract rows; rows are {fields}")
    accepted = [f"accepted unverified: {row.field}: {reason}" for row, reason in rows if row.field in settings.accept_unverified]
    return [(row, reason) for row, reason in rows if row.field not in settings.accept_unverified], accepted
