"""The diagnosis report: the first divergence, the per-op records and table, JSON and the plot.

:class:`Report` is what :func:`true_on_policy.diagnose.diagnose` returns; ``CATEGORIES`` and ``RULES``
name the four categories and the four rules its verdicts refer to. No model code here.
"""

from __future__ import annotations

import dataclasses
import json
import math


CATEGORIES = ("operator", "implementation", "parallel", "weights")


RULES = {
    1: "rule 1 (visible-token semantics: select visible keys with torch.where/-inf, never add a large "
    "negative mask; zero the values of invisible slots)",
    2: "rule 2 (fixed reduction order / fixed split: batch-invariant tiles, fixed K split, fixed-tree "
    "sums, stable tie-break)",
    3: "rule 3 (same online-softmax KV block size and rescale cadence for training, prefill and decode)",
    4: "rule 4 (same precision at sensitive points: fp32 accumulation, softmax, RoPE and routing; "
    "same eps and casts)",
}


@dataclasses.dataclass
class Divergence:
    """The first op whose inputs are bitwise equal on both sides while its outputs differ."""

    layer: int | None  # decoder layer index, None outside the layers
    op: str  # qualified name, e.g. "model.layers.1.post_attention_layernorm" (pseudo-ops: ".rope"...)
    category: str  # one of CATEGORIES
    fix: str  # one line, in terms of the four consistency rules
    kind: str  # norm, linear, attention, rope, router, topk, experts, ...
    sequence: int  # where it shows first: sequence index ...
    position: int  # ... and token position
    max_abs_diff: float  # max |Δ| of the op's outputs at that token
    inputs_equal: bool  # False only when no op with equal inputs differs (cause outside the captured ops)
    details: list[str]  # the evidence: what differs between the two modules

    def summary(self) -> str:
        where = "-" if self.layer is None else self.layer
        return f"layer {where}, op {self.op}, category {self.category}"


@dataclasses.dataclass
class OpRecord:
    """One row of the per-layer, per-op table."""

    op: str
    layer: int | None
    name: str  # the op's name within its layer (or the full name outside the layers)
    kind: str
    order: int  # execution order on the training side (rollout-only ops come last)
    sides: str  # "both", "training" (never ran on the rollout side) or "rollout"
    # the comparison (zero where the op was not compared, e.g. it ran on one side only)
    tokens: int = 0  # tokens compared
    tokens_differing: int = 0  # tokens whose outputs are not bitwise equal
    max_abs: float = 0.0  # max |Δ| over the outputs of all compared tokens (inf: non-finite on one side)
    mean_abs: float = 0.0  # mean |Δ| over all output elements of all compared tokens
    first_diff: tuple[int, int] | None = None  # (sequence, position) of the first differing token
    inputs_differing: int = 0  # tokens whose inputs already differ

    @property
    def equal(self) -> bool:
        return self.sides == "both" and self.tokens_differing == 0


@dataclasses.dataclass
class Report:
    first_divergence: Divergence | None
    ops: list[OpRecord]  # execution order
    logprobs: dict  # token log-probs of the response tokens: max_abs, mean_abs, equal, tokens
    settings: dict

    @property
    def table(self) -> list[dict]:
        """The per-layer, per-op table: one dict per op, in execution order."""
        return [_record_dict(r) for r in self.ops]

    def to_dict(self) -> dict:
        return {
            "first_divergence": None if self.first_divergence is None else dataclasses.asdict(self.first_divergence),
            "logprobs": self.logprobs,
            "settings": self.settings,
            "table": self.table,
        }

    def to_json(self, path=None, indent: int = 1) -> str:
        text = json.dumps(self.to_dict(), indent=indent, default=str)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    def format(self, only_differing: bool = False) -> str:
        """The human-readable report: settings, log-prob |Δ|, the table, the first divergence."""
        s, lp = self.settings, self.logprobs
        lines = [
            f"true-on-policy diagnose: {s.get('model', '?')} {s['dtype']}, consistent kernels "
            f"{'ON' if s['deterministic'] else 'OFF'}, {s['sequences']} sequences, {s['tokens']} tokens "
            f"(training: one padded batch {s['training_batch']}; rollout: {s['rollout_calls']} forward_packed calls)",
        ]
        if s.get("fault"):
            lines.append(f"injected on the rollout copy: {s['fault']}")
        lines.append(
            f"token log-probs ({lp['tokens']} response tokens): max|Δ| {_fmt(lp['max_abs'])}  "
            f"mean|Δ| {_fmt(lp['mean_abs'])}  bitwise equal {lp['equal']}/{lp['tokens']}"
        )
        lines.append("")
        lines.append(f"    {'layer':>5}  {'op':<34} {'max|Δ|':>9} {'mean|Δ|':>9} {'differ':>9}  first diff")
        first = self.first_divergence.op if self.first_divergence else None
        for r in self.ops:
            if only_differing and r.equal and r.op != first:
                continue
            mark = ">>" if r.op == first else "  "
            layer = "-" if r.layer is None else str(r.layer)
            if r.sides != "both":
                lines.append(f"{mark}  {layer:>5}  {r.name:<34} {'(ran on the ' + r.sides + ' side only)':>40}")
                continue
            where = "" if r.first_diff is None else f"seq {r.first_diff[0]} pos {r.first_diff[1]}"
            lines.append(
                f"{mark}  {layer:>5}  {r.name:<34} {_fmt(r.max_abs):>9} {_fmt(r.mean_abs):>9} "
                f"{f'{r.tokens_differing}/{r.tokens}':>9}  {where}"
            )
        lines.append("")
        d = self.first_divergence
        if d is None:
            lines.append("no divergence: every captured op is bitwise equal on both sides, token by token")
        else:
            lines.append(f"FIRST DIVERGENCE: {d.summary()}")
            state = (
                "inputs bitwise equal, outputs differ"
                if d.inputs_equal
                else "inputs already differ (the cause is upstream of every captured op)"
            )
            lines.append(f"  at sequence {d.sequence}, position {d.position}: {state} (max|Δ| {_fmt(d.max_abs_diff)})")
            for detail in d.details:
                lines.append(f"  evidence: {detail}")
            lines.append(f"  fix: {d.fix}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def plot(self, path, title: str | None = None) -> None:
        """A PNG heatmap of max |Δ| (log scale) by layer (columns) and op (rows); the first
        divergence is outlined. Zero cells are white, ops that did not run are grey."""
        _plot(self, path, title)


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if math.isinf(x):
        return "inf"
    if math.isnan(x):
        return "nan"
    return f"{x:.2e}"


def _record_dict(r: OpRecord) -> dict:
    d = dataclasses.asdict(r)
    d["first_diff"] = None if r.first_diff is None else list(r.first_diff)
    return d


def _layout(report: Report):
    """The heatmap's columns (embed, one per layer, head), its rows (op names: those before the layers,
    the layers' ops, those after) and ``cell(record) -> (row, column)``."""
    layers = sorted({r.layer for r in report.ops if r.layer is not None})
    in_order = sorted(report.ops, key=lambda r: r.order)
    seen_layer = False
    pre, post = [], []
    for r in in_order:
        if r.layer is not None:
            seen_layer = True
        elif r.op != "model":
            (post if seen_layer else pre).append(r)
    columns = ["embed"] + [f"L{i}" for i in layers] + ["head"]
    row_names: list[str] = [r.name for r in pre]
    for r in in_order:
        if r.layer is not None and r.name not in row_names:
            row_names.append(r.name)
    row_names += [r.name for r in post if r.name not in row_names]

    def cell(r: OpRecord) -> tuple[int, int]:
        col = 0 if r in pre else (len(columns) - 1 if r in post else 1 + layers.index(r.layer))
        return row_names.index(r.name), col

    return columns, row_names, cell


def _print_values(ax, data, ran, vmin: float, vmax: float, big: float) -> None:
    """Each cell's max |Δ| as text (zero grey, non-finite as inf)."""
    middle = math.sqrt(vmin * vmax)
    for i in range(len(ran)):
        for j in range(len(ran[i])):
            if not ran[i][j]:
                continue
            value = data[i][j]
            if value == 0:
                ax.text(j, i, "0", ha="center", va="center", fontsize=6, color="#888888")
            else:
                text = "inf" if value >= big else f"{value:.1e}"
                color = "white" if value < middle else "black"
                ax.text(j, i, text, ha="center", va="center", fontsize=5.5, color=color)


def _plot(report: Report, path, title: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.patches import Rectangle

    columns, row_names, cell = _layout(report)
    grid = [[math.nan] * len(columns) for _ in row_names]
    ran = [[False] * len(columns) for _ in row_names]
    for r in report.ops:
        if r.op != "model" and r.sides == "both":
            row, col = cell(r)
            grid[row][col] = r.max_abs
            ran[row][col] = True
    values = [v for line in grid for v in line if not math.isnan(v) and v > 0 and math.isfinite(v)]
    vmin = min(values) if values else 1e-8
    vmax = max(values) if values else 1.0
    vmax = max(vmax, vmin * 10)
    big = max(vmax * 10, 1.0)
    data = np.where(np.isinf(np.array(grid, dtype=float)), big, np.array(grid, dtype=float))
    masked = np.ma.masked_where(~(data > 0), data)
    fig_h = 1.2 + 0.22 * len(row_names)
    fig_w = 3.2 + 0.7 * len(columns)
    fig, ax = plt.subplots(figsize=(min(fig_w, 16), min(fig_h, 14)), dpi=80)
    cmap = plt.get_cmap("viridis").with_extremes(over="red")
    ran_arr = np.array(ran)
    zero = np.ma.masked_where(~(ran_arr & (np.nan_to_num(data) == 0)), np.ones_like(data))
    absent = np.ma.masked_where(ran_arr, np.ones_like(data))
    ax.imshow(absent, cmap=ListedColormap(["#d9d9d9"]), aspect="auto", interpolation="nearest")
    ax.imshow(zero, cmap=ListedColormap(["white"]), aspect="auto", interpolation="nearest")
    im = ax.imshow(masked, cmap=cmap, norm=LogNorm(vmin=vmin, vmax=vmax), aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(columns)))
    ax.set_xticklabels(columns, fontsize=7)
    ax.set_yticks(range(len(row_names)))
    ax.set_yticklabels(row_names, fontsize=7)
    if len(columns) <= 12:  # small grids: print the values
        _print_values(ax, data, ran, vmin, vmax, big)
    bar = fig.colorbar(im, ax=ax, extend="max")
    bar.set_label("max |Δ| (log; red: non-finite on one side)", fontsize=7)
    bar.ax.tick_params(labelsize=6)
    d = report.first_divergence
    if d is not None:
        rec = next((r for r in report.ops if r.op == d.op), None)
        if rec is not None and rec.op != "model":
            row, col = cell(rec)
            ax.add_patch(Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, ec="red", lw=2))
    s = report.settings
    kernels = "consistent" if s["deterministic"] else "default"
    head = title or f"training vs rollout, {s.get('model', '')} {s['dtype']}, kernels {kernels}"
    sub = "no divergence" if d is None else f"first: {d.op} ({d.category})"
    ax.set_title(f"{head}\n{sub}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
