"""The contract's rows: a :class:`Side` per engine, a :class:`Row` and its :class:`Status` decided once
(:func:`judged`), the :class:`Contract`; :func:`compare` lists the mismatches with their fixes,
:func:`unverified` what cannot be verified, :func:`format_table` prints both sides. :class:`Context` is
what every row builder (the ``*_rows`` modules of this package) reads. Pure: no verl, no omegaconf.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

from true_on_policy.config.launch import RolloutView, TrainingView
from true_on_policy.config.platforms import Platform
from true_on_policy.config.settings import Settings
from true_on_policy.contract.determinism_plan import Plan
from true_on_policy.contract.names import AUTO, UNVERIFIED
from true_on_policy.kernels.architectures import Checkpoint

INFO, STRICT, REQUIRE = "info", "strict", "require"


class Status(str, enum.Enum):
    """A row's state, decided once when the contract is built."""

    OK = "ok"
    MISMATCH = "mismatch"
    UNVERIFIED = "unverified"  # holds where visible, but no setting pins a side (refused unless accepted)
    INFO = "info"  # shown, not checked
    OFF = "off"  # checked only when deterministic


@dataclasses.dataclass(frozen=True)
class Side:
    """One side of a row: the value and the key (or upstream file) it comes from; ``display`` how to show it."""

    value: Any
    source: str
    display: str | None = None

    def show(self) -> str:
        return str(self.display if self.display is not None else self.value)


def _fmt(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def as_size(value: Any) -> int:
    """An already validated size (an int), or 1 for a side that has none (``UNVERIFIED``, ``n/a``)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


@dataclasses.dataclass(frozen=True)
class Row:
    """One contract field, its two sides and how they must relate; ``status`` and ``reason`` are decided
    once (:func:`judged`), when the contract is built or a row replaced."""

    field: str
    title: str
    training: Side
    rollout: Side
    kind: str = STRICT  # info | strict | require
    required: Any = None  # pinned value both known sides must have (strict) / the rollout side must have (require)
    required_source: str = ""
    reject_auto: bool = False  # under determinism, "auto" is an unpinned kernel choice
    only_when_deterministic: bool = False
    fix: str = ""
    unverified: str = ""  # why this row cannot be verified even where its values agree ("" = decided by values)
    accepted: str = ""  # why differing values are not a mismatch ("" = they are)
    status: Status | None = None  # decided by judged when the contract is built
    reason: str = ""  # why the status (a mismatch, an unverified side)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    field: str
    title: str
    training: Any
    rollout: Any
    training_source: str
    rollout_source: str
    reason: str
    fix: str

    def line(self) -> str:
        return (
            f"{self.title} [{self.field}]: training={_fmt(self.training)} ({self.training_source}) vs "
            f"rollout={_fmt(self.rollout)} ({self.rollout_source}): {self.reason}; fix: {self.fix}"
        )

    __str__ = line


@dataclasses.dataclass(frozen=True)
class Contract:
    platform: str
    deterministic: bool
    training_engine: str
    rollout_engine: str
    rows: tuple[Row, ...]
    notes: tuple[str, ...] = ()
    plan: Any = None

    def row(self, field: str) -> Row:
        for row in self.rows:
            if row.field == field:
                return row
        raise KeyError(field)


    def as_dict(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "deterministic": self.deterministic,
            "training_engine": self.training_engine,
            "rollout_engine": self.rollout_engine,
            "rows": [
                {
                    "field": r.field,
                    "title": r.title,
                    "kind": r.kind,
                    "training": r.training.value,
                    "training_source": r.training.source,
                    "rollout": r.rollout.value,
                    "rollout_source": r.rollout.source,
                    "required": r.required,
                    "status": r.status.value,
                    "reason": r.reason,
                }
                for r in self.rows
            ],
            "notes": list(self.notes),
        }




@dataclasses.dataclass
class Layout:
    tp: Side
    ep: Side
    etp: Side
    pp: Side
    cp: Side
    dp: Side
    extra: dict[str, Side]


@dataclasses.dataclass
class Context:
    """What every row builder reads: both sides' views with the plan laid over them, the section, and
    what follows from it, computed once."""

    t: TrainingView
    r: RolloutView
    settings: Settings
    plan: Plan
    notes: list[str]
    checkpoint: Checkpoint | None  # the model's config.json, judged once; None: not a local checkpoint
    platform: Platform | None = None
    deterministic: bool = True
    project: bool = False  # the flag switches on the project's kernels (training: unless Megatron)
    project_rollout: bool = False  # the rollout runs them: its CPU engine, or vLLM through the adapter
    strategy: str = ""
    name: str = ""
    rollout_env: dict[str, str] = dataclasses.field(default_factory=dict)
    tl: Layout | None = None
    rl: Layout | None = None
    # each layer's type as the architecture table derives it (Checkpoint.layer_types); () without a checkpoint
    layer_types: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------
# status, compare, table
# --------------------------------------------------------------------------------------------


def judged(row: Row, deterministic: bool) -> Row:
    """``row`` with its status and the reason, decided from its two sides (and the flag)."""
    status, reason = _status(row, deterministic)
    return dataclasses.replace(row, status=status, reason=reason)


def _status(row: Row, deterministic: bool) -> tuple[Status, str]:
    if row.kind == INFO:
        return Status.INFO, ""
    if row.only_when_deterministic and not deterministic:
        return Status.OFF, ""
    t, r = row.training.value, row.rollout.value
    if row.kind == REQUIRE:
        if r == UNVERIFIED:
            return Status.UNVERIFIED, ""
        if r != row.required:
            return Status.MISMATCH, f"rollout must be {row.required} ({row.required_source})"
        return (Status.UNVERIFIED, row.unverified) if row.unverified else (Status.OK, "")
    if row.reject_auto and deterministic and AUTO in (t, r):
        side = "training" if t == AUTO else "rollout"
        return Status.MISMATCH, f"{side} kernel is chosen by the engine at run time (unpinned)"
    if UNVERIFIED in (t, r):
        known = r if t == UNVERIFIED else t
        if row.required is not None and known not in (UNVERIFIED, row.required):
            return Status.MISMATCH, f"must be {row.required} ({row.required_source})"
        side = row.training if t == UNVERIFIED else row.rollout
        return Status.UNVERIFIED, row.unverified or f"{'training' if t == UNVERIFIED else 'rollout'}: {side.source}"
    if row.required is not None and row.required not in (t, r):
        return Status.MISMATCH, f"both sides must be {row.required} ({row.required_source})"
    if t != r:
        if row.accepted:
            return Status.OK, row.accepted
        if row.unverified:
            return Status.UNVERIFIED, row.unverified
        if row.required is not None:
            return Status.MISMATCH, f"both sides must be {row.required} ({row.required_source})"
        return Status.MISMATCH, "differs"
    if row.unverified:
        return Status.UNVERIFIED, row.unverified
    return Status.OK, ""


def unverified(contract: Contract) -> list[tuple[Row, str]]:
    """Every row that holds where it can be seen but cannot be verified, with the reason."""
    return [(row, row.reason) for row in contract.rows if row.status is Status.UNVERIFIED]


def compare(contract: Contract) -> list[Mismatch]:
    """Every strict/required row that does not hold, with both values and the fix."""
    out: list[Mismatch] = []
    for row in contract.rows:
        if row.status is Status.MISMATCH:
            out.append(
                Mismatch(
                    field=row.field,
                    title=row.title,
                    training=row.training.value,
                    rollout=row.rollout.value,
                    training_source=row.training.source,
                    rollout_source=row.rollout.source,
                    reason=row.reason,
                    fix=row.fix,
                )
            )
    return out


def format_table(contract: Contract, mismatches: list[Mismatch] | None = None) -> str:
    """Side-by-side table: one line per field, sources below, then notes. The verdict (what holds,
    what is refused) is :mod:`true_on_policy.contract.verdict`'s text, not repeated here."""
    if mismatches is None:
        mismatches = compare(contract)
    bad = {m.field for m in mismatches}
    header = (
        f"true-on-policy contract  platform={contract.platform}  deterministic={contract.deterministic}  "
        f"training={contract.training_engine}  rollout={contract.rollout_engine}"
    )
    rows = [("field", "training", "rollout", "status")]
    for row in contract.rows:
        state = row.status.value
        mark = {"mismatch": "MISMATCH", "unverified": "unverified", "ok": "ok", "info": "-", "off": "off"}[state]
        if row.field in bad:
            mark = "MISMATCH"
        t = row.training.show() if row.training.display is not None else _fmt(row.training.value)
        r = row.rollout.show() if row.rollout.display is not None else _fmt(row.rollout.value)
        if row.required is not None and state != "info":
            mark += f" (pin {row.required})"
        rows.append((row.title, _clip(t), _clip(r), mark))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [header, "=" * len(header)]
    for i, r in enumerate(rows):
        lines.append(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  ------")
    for row in contract.rows:
        if isinstance(row.training.value, dict) or isinstance(row.rollout.value, dict):
            t = row.training.value if isinstance(row.training.value, dict) else {}
            r = row.rollout.value if isinstance(row.rollout.value, dict) else {}
            lines.append("")
            lines.append(f"{row.title} (training | rollout):")
            for key in sorted(set(t) | set(r)):
                flag = "" if t.get(key) == r.get(key) else "   <-- differs"
                lines.append(f"  {key}: {t.get(key, '<unset>')} | {r.get(key, '<unset>')}{flag}")
    lines.append("")
    lines.append("sources (training | rollout):")
    for row in contract.rows:
        lines.append(f"  {row.title}: {row.training.source} | {row.rollout.source}")
    if contract.notes:
        lines.append("notes:")
        lines += [f"  - {n}" for n in contract.notes]
    return "\n".join(lines)


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
