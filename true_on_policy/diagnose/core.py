"""Residual-logdiff diagnosis: the first op where the training and the rollout paths diverge.

:func:`diagnose` runs the same token sequences through both paths of the plugin and captures every
module's inputs and outputs with forward hooks:

* training: ONE right-padded batch ``[B, T]`` through ``training_model(input_ids, attention_mask,
  position_ids)`` -- the padded path of the training forward (verl's ``use_remove_padding=False``);
* rollout: every prompt prefilled and every remaining token decoded one at a time (teacher forced)
  through :func:`consistent_model.forward_packed` over per-request :class:`KVCache` objects, all
  requests in one ragged batch per step (continuous batching) on ``rollout_model``.

Both run with the consistent kernels (``consistent_ops.consistent(True)`` + ``patch_transformers()``)
when ``deterministic`` is true, with transformers' default kernels otherwise. Every captured row is
mapped back to its ``(sequence, position)``, so the ops are compared token by token.

Besides the modules themselves (embedding, rotary table, norms, q/k/v/o projections, QK-norms,
MLP projections and activation, MoE router, experts, decoder layers, final norm, LM head) a few
*pseudo-ops* are captured where the model does work outside a module:

* ``<attn>.rope``: ``apply_rotary_pos_emb`` of that attention (q, k, cos, sin -> rotated q, k);
* ``<attn>.attention``: the attention kernel (rotated q, k and v -> the o_proj input);
* ``<moe>.gate.topk``: the router's softmax/top-k (router logits -> weights, expert indices; the
  ``gate`` op itself then compares the router logits only);
* ``<moe>.experts.combine``: the weighted combination of the expert outputs (consistent path only);
* ``log_softmax``: the log-softmax of the logits that log-probs are read from.

The first divergence is found by the rules of the issue: take the earliest token position at which
any op's output differs; there, walk the ops in the training side's execution order and keep the
ones whose inputs are bitwise equal while their outputs differ (an op whose inputs already differ
is downstream of the cause); prefer an op over the module containing it; the earliest remaining
op is the first divergence. It is classified by comparing the two modules:

``parallel``        sharding differs: TP/EP/SP attributes (``tp_size``, ``tp_rank``, ``world_size``,
                    ``reduce_results``, ...), DTensor placements or device-mesh shapes, parameter
                    shapes (a shard). Only seen when a model copy carries such attributes (a TP/EP
                    module, an FSDP2/DTensor model); two full copies in one process never show it.
``weights``         a parameter or buffer has other values (same dtype and shape).
``implementation``  the module is configured or composed differently: class, forward function,
                    plain attributes (``variance_epsilon``, ``scaling``, ``top_k``...), parameter
                    dtypes, child modules, the children actually executed (an extra or a missing
                    op), the runtime-relevant config (``_attn_implementation``, ``hidden_act``, RoPE).
``operator``        nothing of the above differs, yet the outputs do: the kernel itself (reduction
                    order, tiling or K split that depends on the batch shape, top-k tie-breaking).

The report also carries a per-layer, per-op table of max / mean |Δ| and the token log-prob |Δ|.
:func:`inject_fault` plants known faults in one model copy (for demos and tests).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from true_on_policy.kernels import model as cm
from true_on_policy.kernels import ops

__all__ = [
    "CATEGORIES",
    "RULES",
    "FAULTS",
    "Divergence",
    "OpRecord",
    "Report",
    "diagnose",
    "inject_fault",
    "make_router_ties",
]

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

# inputs that describe the layout, not the data (rule 1: a mask is a selection, compared via outputs)
_SKIP_INPUTS = {
    "attention_mask",
    "past_key_values",
    "cache_position",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "logits_to_keep",
    "labels",
    cm.ROLLOUT_KWARG,
}
_RULE_REF = {
    "r1": "rule 1: selection, not additive masks",
    "r2": "rule 2: fixed reduction order / split",
    "r3": "rule 3: same online-softmax block size and rescale cadence",
    "r4": "rule 4: same precision at sensitive points",
}
_PARALLEL_ATTRS = (
    "tp_size",
    "tp_rank",
    "tp_world_size",
    "tensor_parallel_size",
    "world_size",
    "rank",
    "ep_size",
    "ep_rank",
    "expert_parallel_size",
    "sp_size",
    "cp_size",
    "input_is_parallel",
    "gather_output",
    "reduce_results",
    "sequence_parallel",
)
_PROCESS_GROUP_ATTRS = ("process_group", "tp_group", "ep_group", "group")
_CONFIG_METADATA = {
    "_name_or_path",
    "name_or_path",
    "transformers_version",
    "architectures",
    "_commit_hash",
    "auto_map",
}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


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
    tokens: int  # tokens compared
    tokens_differing: int  # tokens whose outputs are not bitwise equal
    max_abs: float  # max |Δ| over the outputs of all compared tokens (inf: non-finite on one side)
    mean_abs: float  # mean |Δ| over all output elements of all compared tokens
    first_diff: tuple[int, int] | None  # (sequence, position) of the first differing token
    inputs_differing: int  # tokens whose inputs already differ

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


# ----------------------------------------------------------------------------------------------
# Op naming
# ----------------------------------------------------------------------------------------------


def _layer_of(op: str) -> int | None:
    m = _LAYER_RE.search(op)
    return int(m.group(1)) if m else None


def _short_name(op: str) -> str:
    m = _LAYER_RE.search(op)
    if not m:
        return op
    rest = op[m.end() :]
    return rest if rest else "(layer output)"


def _base(op: str) -> str:
    return op.split("#")[0]


def _kind(op: str) -> str:
    base = _base(op)
    last = base.rsplit(".", 1)[-1]
    if base == "log_softmax":
        return "log_softmax"
    if last == "rope":
        return "rope"
    if last == "attention":
        return "attention"
    if last == "topk":
        return "topk"
    if last == "combine":
        return "combine"
    if last == "rotary_emb":
        return "rope_table"
    if "embed" in last:
        return "embedding"
    if last == "lm_head":
        return "lm_head"
    if "norm" in last:
        return "norm"
    if last.endswith("_proj"):
        return "linear"
    if last == "gate" and ".mlp." in base + ".":
        return "router"
    if last == "experts":
        return "experts"
    if last in ("act_fn", "act"):
        return "activation"
    if last == "mlp":
        return "mlp"
    if last in ("self_attn", "attn"):
        return "attention_block"
    if _LAYER_RE.search(base) and _short_name(base) == "(layer output)":
        return "decoder_layer"
    return "module"


def _is_ancestor(a: str, b: str) -> bool:
    """Is op ``a`` a module containing op ``b``?"""
    a, b = _base(a), _base(b)
    return a != b and (a == "" or b.startswith(a + "."))


# ----------------------------------------------------------------------------------------------
# Capture
# ----------------------------------------------------------------------------------------------


def _flatten(obj, prefix: str, out: dict) -> dict:
    if torch.is_tensor(obj):
        out[prefix] = obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _flatten(value, f"{prefix}[{i}]", out)
    return out


class _Side:
    """Hooks on one model for one side. ``captures`` holds the current forward's token rows per op
    (inputs and outputs); ``order``, ``executed`` and ``owner`` accumulate over all forwards."""

    def __init__(self, model: nn.Module, name: str):
        self.model = model
        self.name = name
        self.lead: tuple[int, int] = (0, 0)  # leading token dims of this forward: (B, T) or (1, N)
        self.captures: dict[str, tuple[dict, dict]] = {}  # op -> (inputs, outputs), this forward
        self.call_counts: dict[str, int] = {}
        self.stack: list[str] = []
        self.order: dict[str, int] = {}  # first-seen order of ops (over all forwards)
        self.executed: dict[str, set[str]] = {}  # module -> names of the children it ran
        self.owner: dict[str, str] = {}  # pseudo-op -> the module it belongs to
        self.handles: list = []
        self.names = {module: name for name, module in model.named_modules()}

    # -- rows ------------------------------------------------------------------------------

    def rows(self, t: torch.Tensor) -> torch.Tensor | None:
        """A tensor as [tokens of this forward, ...], or None if it is not token-aligned."""
        b, n = self.lead
        count = b * n
        if t.dim() >= 2 and tuple(t.shape[:2]) == (b, n):
            return t.reshape(count, *t.shape[2:])
        if t.dim() >= 1 and t.shape[0] == count:
            return t
        return None

    def _token_rows(self, tensors: dict) -> dict:
        out = {}
        for key, t in tensors.items():
            r = self.rows(t.detach())
            if r is not None:
                out[key] = r
        return out

    def record(self, op: str, inputs: dict, outputs: dict, owner: str | None = None) -> str:
        count = self.call_counts.get(op, 0)
        self.call_counts[op] = count + 1
        key = op if count == 0 else f"{op}#{count}"
        self.order.setdefault(key, len(self.order))
        if owner is not None:
            self.owner[key] = owner
        self.captures[key] = (self._token_rows(inputs), self._token_rows(outputs))
        return key

    # -- hooks -----------------------------------------------------------------------------

    def _pre(self, module, args, kwargs):
        name = self.names[module]
        if self.stack:
            self.executed.setdefault(self.stack[-1], set()).add(name.rsplit(".", 1)[-1])
        if name.endswith(".o_proj") and self.stack:  # the attention kernel ran just before o_proj
            self._attention_pseudo_op(self.stack[-1], args, kwargs)
        self.stack.append(name)
        count = self.call_counts.get(name, 0)
        self.order.setdefault(name if count == 0 else f"{name}#{count}", len(self.order))

    def _post(self, module, args, kwargs, output):
        name = self.names[module]
        self.stack.pop()
        inputs = {}
        for i, a in enumerate(args):
            _flatten(a, f"arg{i}", inputs)
        for k, v in kwargs.items():
            if k not in _SKIP_INPUTS:
                _flatten(v, k, inputs)
        outputs = _flatten(output, "out", {})
        router = (
            isinstance(output, tuple)
            and len(output) == 3
            and all(torch.is_tensor(o) for o in output)
            and not output[2].is_floating_point()
            and _kind(name) == "router"
        )
        if router:  # the router's logits, then a pseudo-op for its softmax/top-k
            logits, weights, experts = output
            self.record(name, inputs, {"logits": logits})
            self.record(name + ".topk", {"logits": logits}, {"weights": weights, "experts": experts}, owner=name)
        else:
            self.record(name, inputs, outputs)

    def _attention_pseudo_op(self, attn: str, args, kwargs):
        """At o_proj's call: the attention kernel's inputs (rotated q, k; v) and output (o_proj's input)."""
        rope = self.captures.get(attn + ".rope")
        rotated = rope[1] if rope is not None else {}
        inputs = {}
        for key, norm in (("q", ".q_norm"), ("k", ".k_norm")):  # without a rope capture: the QK-norm outputs
            t = rotated.get(key)
            if t is None and attn + norm in self.captures:
                t = self.captures[attn + norm][1].get("out")
            if t is not None:
                inputs[key] = t
        v = self.captures.get(attn + ".v_proj")
        if v is not None and "out" in v[1]:
            inputs["v"] = v[1]["out"]
        x = args[0] if args else kwargs.get("input")
        key = attn + ".attention"
        count = self.call_counts.get(key, 0)
        self.call_counts[key] = count + 1
        key = key if count == 0 else f"{key}#{count}"
        self.order.setdefault(key, len(self.order))
        self.owner[key] = attn
        self.captures[key] = (inputs, self._token_rows({"out": x}))

    def _rope_wrapper(self, original):
        side = self

        @functools.wraps(original)
        def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
            out = original(q, k, cos, sin, *args, **kwargs)
            if side.stack:
                attn = side.stack[-1]
                # [B, H, T, D] -> [B, T, H, D] so that tokens lead
                side.record(
                    attn + ".rope",
                    {"q": q.transpose(1, 2), "k": k.transpose(1, 2), "cos": cos, "sin": sin},
                    {"q": out[0].transpose(1, 2), "k": out[1].transpose(1, 2)},
                    owner=attn,
                )
            return out

        return apply_rotary_pos_emb

    def _combine_wrapper(self, original):
        side = self

        @functools.wraps(original)
        def moe_combine(expert_outputs, weights):
            out = original(expert_outputs, weights)
            if side.stack:
                experts = side.stack[-1]
                side.record(
                    experts + ".combine",
                    {"expert_outputs": expert_outputs, "weights": weights},
                    {"out": out},
                    owner=experts,
                )
            return out

        return moe_combine

    @contextlib.contextmanager
    def hooked(self):
        root = self.model
        for name, module in root.named_modules():
            if module is root or isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                continue
            self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post, with_kwargs=True))
        swapped = []
        modeling = {sys.modules.get(type(m).__module__) for m in root.modules()}
        for mod in modeling:
            if mod is not None and callable(getattr(mod, "apply_rotary_pos_emb", None)):
                original = mod.apply_rotary_pos_emb
                swapped.append((mod, "apply_rotary_pos_emb", original))
                mod.apply_rotary_pos_emb = self._rope_wrapper(original)
        swapped.append((ops, "moe_combine", ops.moe_combine))
        ops.moe_combine = self._combine_wrapper(ops.moe_combine)
        try:
            yield self
        finally:
            for owner, attr, original in reversed(swapped):
                setattr(owner, attr, original)
            for h in self.handles:
                h.remove()
            self.handles.clear()

    def begin(self, lead: tuple[int, int]) -> None:
        self.lead = lead
        self.captures = {}
        self.call_counts = {}
        self.stack = []


# ----------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------


def _rows_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row: bitwise equal (NaN equal to NaN at the same place)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return torch.zeros(a.shape[0], dtype=torch.bool)
    eq = a == b
    if a.is_floating_point():
        eq = eq | (torch.isnan(a) & torch.isnan(b))
    return eq.reshape(a.shape[0], -1).all(dim=1)


def _rows_absdiff(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per row: (max |Δ|, sum |Δ|) in fp64, elements per row. Integer tensors count a mismatch as 1;
    a non-finite value on one side only is an infinite difference."""
    n = a.shape[0]
    if a.shape != b.shape:
        inf = torch.full((n,), math.inf, dtype=torch.float64)
        return inf, inf, 1
    if not a.is_floating_point():
        d = (a != b).to(torch.float64)
    else:
        x, y = a.to(torch.float64), b.to(torch.float64)
        same = (x == y) | (torch.isnan(x) & torch.isnan(y))
        d = torch.where(same, 0.0, (x - y).abs())
        d = torch.nan_to_num(d, nan=math.inf)
    d = d.reshape(n, -1)
    return d.amax(dim=1) if d.shape[1] else torch.zeros(n, dtype=torch.float64), d.sum(dim=1), d.shape[1]


class _OpStats:
    def __init__(self, size: int):
        self.seen = torch.zeros(size, dtype=torch.bool)
        self.in_eq = torch.ones(size, dtype=torch.bool)
        self.out_eq = torch.ones(size, dtype=torch.bool)
        self.max_abs = torch.zeros(size, dtype=torch.float64)
        self.sum_abs = torch.zeros(size, dtype=torch.float64)
        self.numel = torch.zeros(size, dtype=torch.float64)


def _compare(train: tuple[dict, dict], roll: tuple[dict, dict], index: torch.Tensor, stats: _OpStats) -> None:
    """Compare a rollout capture (rows in call order) with the training rows at ``index``."""
    t_in, t_out = train
    r_in, r_out = roll
    n = index.shape[0]
    in_eq = torch.ones(n, dtype=torch.bool)
    for key in t_in.keys() & r_in.keys():
        in_eq &= _rows_equal(t_in[key][index], r_in[key].cpu())
    out_eq = torch.ones(n, dtype=torch.bool)
    max_abs = torch.zeros(n, dtype=torch.float64)
    sum_abs = torch.zeros(n, dtype=torch.float64)
    numel = 0
    keys = t_out.keys() | r_out.keys()
    for key in keys:
        if key not in t_out or key not in r_out:  # an output on one side only
            out_eq[:] = False
            max_abs[:] = math.inf
            continue
        a, b = t_out[key][index], r_out[key].cpu()
        out_eq &= _rows_equal(a, b)
        m, s, k = _rows_absdiff(a, b)
        max_abs = torch.maximum(max_abs, m)
        sum_abs += s
        numel += k
    stats.seen[index] = True
    stats.in_eq[index] = in_eq
    stats.out_eq[index] = out_eq
    stats.max_abs[index] = max_abs
    stats.sum_abs[index] = sum_abs
    stats.numel[index] = float(numel)


# ----------------------------------------------------------------------------------------------
# Classification
# ----------------------------------------------------------------------------------------------


def _module(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:
        return None


def _simple(value) -> bool:
    if isinstance(value, (bool, int, float, str, type(None), torch.dtype)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_simple(v) for v in value)
    return False


def _same(a, b) -> bool:
    try:
        return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    except Exception:
        return a is b


def _qualname(obj) -> str:
    obj = getattr(obj, "__func__", obj)
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _parallel_signature(module: nn.Module) -> dict:
    sig = {}
    attrs = vars(module)
    for attr in _PARALLEL_ATTRS:
        if attr in attrs and _simple(attrs[attr]):
            sig[attr] = attrs[attr]
    for attr in _PROCESS_GROUP_ATTRS:
        group = attrs.get(attr)
        if group is not None:
            size = getattr(group, "size", None)
            rank = getattr(group, "rank", None)
            with contextlib.suppress(Exception):
                sig[f"{attr}.size"] = size() if callable(size) else size
            with contextlib.suppress(Exception):
                sig[f"{attr}.rank"] = rank() if callable(rank) else rank
    for pname, p in module.named_parameters(recurse=False):
        placements = getattr(p, "placements", None)
        if placements is not None:
            sig[f"{pname}.placements"] = str(placements)
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                sig[f"{pname}.mesh"] = tuple(getattr(mesh, "shape", ()))
    return sig


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(module.named_parameters())
    out.update(dict(module.named_buffers()))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor
    return (to_local() if callable(to_local) else t).detach()


def _config_signature(config) -> dict:
    sig = {}
    with contextlib.suppress(Exception):
        for key, value in config.to_dict().items():
            if key not in _CONFIG_METADATA and not key.startswith("_"):
                sig[f"config.{key}"] = repr(value)
    sig["config._attn_implementation"] = getattr(config, "_attn_implementation", None)
    return sig


def _module_signature(module: nn.Module, executed: set[str] | None) -> dict:
    sig = {"class": _qualname(type(module))}
    sig["forward"] = _qualname(type(module).forward)
    if "forward" in vars(module):
        sig["forward"] = f"instance override {_qualname(vars(module)['forward'])}"
    for key, value in vars(module).items():
        if not key.startswith("_") and _simple(value):
            sig[f"attribute {key}"] = value
    for name, child in module._modules.items():
        sig[f"child {name}"] = None if child is None else _qualname(type(child))
    sig["children executed"] = tuple(sorted(executed or ()))
    config = vars(module).get("config")
    if config is not None:
        sig.update(_config_signature(config))
    return sig


def _pseudo_signature(kind: str, owner: nn.Module | None) -> dict:
    if owner is None:
        return {}
    if kind == "attention":
        sig = {f"attribute {k}": v for k, v in vars(owner).items() if not k.startswith("_") and _simple(v)}
        config = vars(owner).get("config")
        impl = getattr(config, "_attn_implementation", None)
        sig["config._attn_implementation"] = impl
        with contextlib.suppress(Exception):
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            if impl in ALL_ATTENTION_FUNCTIONS:
                sig["attention function"] = _qualname(ALL_ATTENTION_FUNCTIONS[impl])
        return sig
    if kind == "topk":
        return {f"attribute {k}": v for k, v in vars(owner).items() if not k.startswith("_") and _simple(v)}
    return {}


def _diff_dicts(a: dict, b: dict) -> list[str]:
    out = []
    for key in list(a) + [k for k in b if k not in a]:
        va, vb = a.get(key, "<absent>"), b.get(key, "<absent>")
        if not _same(va, vb):
            out.append(f"{key}: training {va!r}, rollout {vb!r}")
    return out


def _classify(
    op: str, kind: str, owner_name: str | None, train: nn.Module, roll: nn.Module, t_side: _Side, r_side: _Side
) -> tuple[str, list[str]]:
    """(category, evidence) for an op whose inputs are equal and outputs differ."""
    pseudo = owner_name is not None or op == "log_softmax"
    name = owner_name if owner_name is not None else _base(op)
    a = None if op == "log_softmax" else _module(train, name)
    b = None if op == "log_softmax" else _module(roll, name)
    if (a is None) != (b is None):
        return "implementation", [f"module {name} exists on one side only"]
    if a is None:
        return "operator", []
    parallel = _diff_dicts(_parallel_signature(a), _parallel_signature(b))
    weights, implementation = [], []
    if not pseudo:
        ta, tb = _tensors(a), _tensors(b)
        for pname in list(ta) + [k for k in tb if k not in ta]:
            x, y = ta.get(pname), tb.get(pname)
            if x is None or y is None:
                implementation.append(f"parameter {name}.{pname} on one side only")
                continue
            x, y = _local(x), _local(y)
            if x.shape != y.shape:
                parallel.append(f"{name}.{pname}: shape {tuple(x.shape)} vs {tuple(y.shape)} (a shard?)")
            elif x.dtype != y.dtype:
                implementation.append(f"{name}.{pname}: dtype training {x.dtype}, rollout {y.dtype}")
            elif not torch.equal(x.cpu(), y.cpu()):
                diff = (x.cpu().double() - y.cpu().double()).abs()
                count = int((x.cpu() != y.cpu()).sum())
                weights.append(f"{name}.{pname}: {count} element(s) differ, max |Δw| {_fmt(float(diff.max()))}")
        sig_a = _module_signature(a, t_side.executed.get(name))
        sig_b = _module_signature(b, r_side.executed.get(name))
    else:
        sig_a, sig_b = _pseudo_signature(kind, a), _pseudo_signature(kind, b)
    implementation += _diff_dicts(sig_a, sig_b)
    if parallel:
        return "parallel", parallel + weights + implementation
    if weights:
        return "weights", weights + implementation
    if implementation:
        return "implementation", implementation
    return "operator", []


_I, _O = "implementation", "operator"
_FIX = {
    (_I, "norm"): "make the norm identical on both engines: same eps, fp32 inside with one cast back "
    "({r4}); sum of squares as a fixed tree ({r2})",
    (_I, "attention"): "run one attention implementation on both engines: selection masking ({r1}), the "
    "same KV block size and rescale cadence ({r3}), fp32 softmax statistics and accumulation ({r4})",
    (_I, "linear"): "same linear kernel and dtypes on both engines: fp32 accumulation, one cast at the end "
    "({r4}); fixed row tiles and K split ({r2})",
    (_I, "lm_head"): "same LM-head kernel on both engines: fp32 logits ({r4}), fixed tiles and K split ({r2})",
    (_I, "router"): "fp32 router logits and softmax on both engines ({r4})",
    (_I, "topk"): "fp32 routing softmax ({r4}) and a stable top-k, ties to the lower expert index ({r2}), "
    "on both engines",
    (_I, "experts"): "same expert kernels on both engines; combine in fp32 in slot order ({r2}, {r4})",
    (_I, "combine"): "combine the expert outputs in fp32 in a fixed slot order on both engines ({r2}, {r4})",
    (_I, "rope"): "one fp32 cos/sin table indexed by absolute position and an fp32 rotation on both "
    "engines ({r4})",
    (_I, "rope_table"): "one fp32 cos/sin table indexed by absolute position on both engines ({r4})",
    (_I, "log_softmax"): "fp32 full-vocabulary log-softmax with a fixed-tree sum on both engines ({r4}, {r2})",
    (_I, "activation"): "same activation code on both engines: fp32 SiLU built from exp ({r4})",
    (_O, "linear"): "the GEMM's reduction order depends on the batch shape (rows, split): use the batch-"
    "invariant fixed-tile, fixed-K-split linear (consistent_ops.linear) on both engines ({r2})",
    (_O, "lm_head"): "the LM-head GEMM's reduction order depends on the batch shape: batch-invariant "
    "fixed-tile linear with fp32 logits on both engines ({r2}, {r4})",
    (_O, "attention"): "the attention kernel reduces differently for the training layout and for prefill/"
    "decode: same KV block size and rescale cadence ({r3}) with fixed-order reductions ({r2})",
    (_O, "norm"): "the norm's mean-square reduction is order-dependent: a fixed-tree sum ({r2}) in fp32 ({r4})",
    (_O, "topk"): "top-k tie-breaking differs between the kernels: a stable sort with ties to the lower expert "
    "index on both engines ({r2})",
    (_O, "router"): "router GEMM/softmax reduce in another order: batch-invariant fp32 routing ({r2}, {r4})",
    (_O, "experts"): "the expert GEMMs or the combine depend on the token grouping: per-row batch-invariant "
    "linears and a fixed slot-order combine ({r2})",
    (_O, "combine"): "the combine adds the slots in another order: fixed left-to-right slot order in fp32 ({r2})",
    (_O, "rope"): "RoPE transcendentals are not position-invariant: one precomputed fp32 table ({r4})",
    (_O, "rope_table"): "cos/sin computed per batch: one precomputed fp32 table indexed by position ({r4})",
    (_O, "log_softmax"): "the vocabulary reduction depends on the batch: fixed-tree fp32 sum ({r2}, {r4})",
    (_O, "activation"): "the activation kernel is not position-invariant: SiLU as x / (1 + exp(-x)) in fp32 ({r4})",
}


def _suggest(category: str, kind: str, details: list[str], nonfinite_one_side: bool) -> str:
    rules = _RULE_REF
    if category == "weights":
        return (
            f"weights differ ({details[0]}): not a kernel rule -- sync the rollout copy bit-exactly from the "
            "trainer (same dtype cast, no requantisation, tied weights tied), then diagnose again"
        )
    if category == "parallel":
        return (
            f"the split differs ({details[0]}): partial sums are added in another order -- use the same TP/EP "
            f"split and collective on both engines or a fixed-order reduction ({rules['r2']})"
        )
    template = _FIX.get((category, kind))
    if template is None:
        template = (
            "make the module's code and configuration identical on both engines ({r4}; {r2})"
            if category == "implementation"
            else "a kernel whose result depends on the batch shape or layout: fixed reduction order ({r2})"
        )
    text = template.format(**rules)
    if nonfinite_one_side:
        text = (
            "non-finite values on one side only: masked (garbage) slots leak into visible rows -- select visible "
            f"keys with torch.where/-inf and zero invisible values, never add a large negative mask ({rules['r1']})"
        )
    if category == "implementation" and details:
        text = details[0] + " -- " + text
    return text


# ----------------------------------------------------------------------------------------------
# diagnose()
# ----------------------------------------------------------------------------------------------


def _prepare(model: nn.Module, deterministic: bool) -> None:
    if getattr(model.config, "_attn_implementation", None) != cm.ATTN_IMPLEMENTATION:
        model.set_attn_implementation(cm.ATTN_IMPLEMENTATION)
    if deterministic:
        cm.convert_model(model)


def _log_softmax(logits: torch.Tensor, deterministic: bool) -> torch.Tensor:
    if deterministic:
        return ops.log_softmax(logits)
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


@torch.no_grad()
def diagnose(
    training_model: nn.Module,
    rollout_model: nn.Module,
    sequences: Sequence[Sequence[int]],
    *,
    prompt_lengths: Sequence[int],
    deterministic: bool = True,
    pad_token_id: int | None = None,
) -> Report:
    """Find the first op where the training and the rollout paths diverge (see the module docstring).

    ``sequences``: token ids (prompt + response) per request; ``prompt_lengths[i]`` (>= 1) tokens of
    sequence i are prefilled, the rest decoded one token per call (teacher forced). Both models must
    be transformers Qwen3 / Qwen3-MoE causal LMs (or of the same structure) with the same
    architecture; they may be the same object. Side effects: ``patch_transformers()`` is called,
    both models are switched to ``attn_implementation="true_on_policy"`` and, when
    ``deterministic``, their linears are converted (:func:`consistent_model.convert_model`).
    Captures are held on the CPU: memory is about one padded training batch of activations for
    every op (keep sequences few and short for a large model).
    """
    sequences = [list(map(int, s)) for s in sequences]
    prompt_lengths = [int(p) for p in prompt_lengths]
    if not sequences:
        raise ValueError("diagnose: no sequences")
    if len(prompt_lengths) != len(sequences):
        raise ValueError(f"diagnose: {len(prompt_lengths)} prompt lengths for {len(sequences)} sequences")
    for i, (s, p) in enumerate(zip(sequences, prompt_lengths)):
        if not 1 <= p <= len(s):
            raise ValueError(f"diagnose: sequence {i} has {len(s)} tokens, prompt length {p} is not in [1, {len(s)}]")
    cm.patch_transformers()
    for model in (training_model, rollout_model):
        _prepare(model, deterministic)
    device = training_model.get_input_embeddings().weight.device
    r_device = rollout_model.get_input_embeddings().weight.device
    B, T = len(sequences), max(len(s) for s in sequences)
    if pad_token_id is None:
        pad_token_id = getattr(training_model.config, "pad_token_id", None) or 0
    ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, s in enumerate(sequences):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
    positions = torch.arange(T)[None].expand(B, T).contiguous()
    valid = mask.bool().reshape(-1)

    # -- training: one padded batch ----------------------------------------------------------
    t_side = _Side(training_model, "training")
    with ops.consistent(deterministic), t_side.hooked():
        t_side.begin((B, T))
        logits = training_model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            use_cache=False,
        ).logits
        lsm = _log_softmax(logits, deterministic)
        t_side.record("log_softmax", {"logits": logits}, {"out": lsm})
    def keep(tensors: dict) -> dict:
        return {k: v.detach().cpu().clone() for k, v in tensors.items()}

    train_caps = {op: (keep(ins), keep(outs)) for op, (ins, outs) in t_side.captures.items()}
    t_side.captures = {}
    train_lsm = train_caps["log_softmax"][1]["out"]  # [B*T, V]

    # -- rollout: prefill + teacher-forced decode over KV caches, continuous batching -----------
    r_side = _Side(rollout_model, "rollout")
    stats: dict[str, _OpStats] = {}
    roll_lsm = torch.zeros_like(train_lsm)
    caches = [cm.KVCache() for _ in sequences]
    done = [0] * B
    calls = 0
    with ops.consistent(deterministic), r_side.hooked():
        while any(d < len(s) for d, s in zip(done, sequences)):
            segments = []
            for i, s in enumerate(sequences):
                if done[i] < len(s):
                    segments.append((i, prompt_lengths[i] if done[i] == 0 else 1))
            seg_ids = torch.cat([torch.tensor(sequences[i][done[i] : done[i] + n]) for i, n in segments])
            seg_pos = torch.cat([torch.arange(done[i], done[i] + n) for i, n in segments])
            index = torch.cat([i * T + torch.arange(done[i], done[i] + n) for i, n in segments])
            r_side.begin((1, int(seg_ids.numel())))
            out = cm.forward_packed(
                rollout_model,
                seg_ids.to(r_device),
                seg_pos.to(r_device),
                [n for _, n in segments],
                [caches[i] for i, _ in segments],
            )
            lsm = _log_softmax(out[None], deterministic)
            r_side.record("log_softmax", {"logits": out[None]}, {"out": lsm})
            roll_lsm[index] = lsm.reshape(-1, lsm.shape[-1]).cpu().to(roll_lsm.dtype)
            for op, capture in r_side.captures.items():
                if op not in train_caps:
                    continue
                if op not in stats:
                    stats[op] = _OpStats(B * T)
                _compare(train_caps[op], capture, index, stats[op])
            r_side.captures = {}
            for i, n in segments:
                done[i] += n
            calls += 1

    # -- the table -----------------------------------------------------------------------------
    def seq_pos(g: int) -> tuple[int, int]:
        return g // T, g % T

    records: list[OpRecord] = []
    all_ops = sorted(t_side.order, key=t_side.order.get)
    rollout_only = [op for op in sorted(r_side.order, key=r_side.order.get) if op not in t_side.order]
    for op in all_ops + rollout_only:
        layer, name, kind = _layer_of(op), _short_name(op), _kind(op)
        order = t_side.order.get(op, len(t_side.order) + r_side.order.get(op, 0))
        st = stats.get(op)
        if st is None:
            sides = "training" if op in t_side.order else "rollout"
            if op in t_side.order and op in r_side.order:
                sides = "both"
            records.append(OpRecord(op, layer, name, kind, order, sides, 0, 0, 0.0, 0.0, None, 0))
            continue
        seen = st.seen & valid
        differ = seen & ~st.out_eq
        first = None
        if bool(differ.any()):
            g = torch.nonzero(differ).flatten()
            pos = g % T
            g0 = int(g[torch.argmin(pos * B + g // T)])
            first = seq_pos(g0)
        numel = float(st.numel[seen].sum())
        records.append(
            OpRecord(
                op=op,
                layer=layer,
                name=name,
                kind=kind,
                order=order,
                sides="both",
                tokens=int(seen.sum()),
                tokens_differing=int(differ.sum()),
                max_abs=float(st.max_abs[seen].max()) if bool(seen.any()) else 0.0,
                mean_abs=float(st.sum_abs[seen].sum()) / numel if numel else 0.0,
                first_diff=first,
                inputs_differing=int((seen & ~st.in_eq).sum()),
            )
        )

    # -- the first divergence -----------------------------------------------------------------
    first_div = None
    differing = [r for r in records if r.sides == "both" and r.tokens_differing]
    if differing:
        p_star = min(r.first_diff[1] for r in differing)
        # every sequence with a difference at p_star (not only the one each op saw first)
        tokens = sorted(
            {
                s
                for s in range(B)
                for r in differing
                if p_star < len(sequences[s]) and not bool(stats[r.op].out_eq[s * T + p_star])
            }
        )
        best = None
        for s in tokens:
            g = s * T + p_star
            diff_here = [r for r in differing if not bool(stats[r.op].out_eq[g])]
            cands = [r for r in diff_here if bool(stats[r.op].in_eq[g])]
            cands = [r for r in cands if not any(_is_ancestor(r.op, o.op) for o in cands)]
            inputs_equal = bool(cands)
            if not cands:  # every differing op already had differing inputs: earliest of them
                cands = diff_here
            r = min(cands, key=lambda r: r.order)
            key = (not inputs_equal, r.order, s)
            if best is None or key < best[0]:
                best = (key, r, s, inputs_equal)
        _, r, s, inputs_equal = best
        g = s * T + p_star
        owner = t_side.owner.get(r.op)
        category, details = _classify(r.op, r.kind, owner, training_model, rollout_model, t_side, r_side)
        nonfinite = math.isinf(float(stats[r.op].max_abs[g]))  # non-finite on one side only (or shapes)
        if nonfinite:
            details = details + ["outputs are non-finite (NaN/inf) on one side only"]
        fix = _suggest(category, r.kind, [d for d in details if "non-finite" not in d], nonfinite)
        first_div = Divergence(
            layer=r.layer,
            op=r.op,
            category=category,
            fix=fix,
            kind=r.kind,
            sequence=s,
            position=p_star,
            max_abs_diff=float(stats[r.op].max_abs[g]),
            inputs_equal=inputs_equal,
            details=details,
        )

    # -- token log-probs of the response tokens --------------------------------------------------
    lp_t, lp_r = [], []
    for b, (s, p) in enumerate(zip(sequences, prompt_lengths)):
        if len(s) > p:
            rows = torch.arange(p - 1, len(s) - 1) + b * T
            labels = torch.tensor(s[p:])
            lp_t.append(train_lsm[rows].gather(-1, labels[:, None]).squeeze(-1))
            lp_r.append(roll_lsm[rows].gather(-1, labels[:, None]).squeeze(-1))
    if lp_t:
        a, b_ = torch.cat(lp_t), torch.cat(lp_r)
        m, sm, _ = _rows_absdiff(a[:, None], b_[:, None])
        logprobs = {
            "max_abs": float(m.max()),
            "mean_abs": float(sm.mean()),
            "equal": int(_rows_equal(a[:, None], b_[:, None]).sum()),
            "tokens": int(a.numel()),
        }
    else:
        logprobs = {"max_abs": 0.0, "mean_abs": 0.0, "equal": 0, "tokens": 0}

    dtype = training_model.get_input_embeddings().weight.dtype
    settings = {
        "model": type(training_model).__name__,
        "deterministic": bool(deterministic),
        "dtype": str(dtype).replace("torch.", ""),
        "rollout_dtype": str(rollout_model.get_input_embeddings().weight.dtype).replace("torch.", ""),
        "sequences": B,
        "tokens": int(valid.sum()),
        "prompt_lengths": prompt_lengths,
        "sequence_lengths": [len(s) for s in sequences],
        "training_batch": [B, T],
        "rollout_calls": calls,
    }
    return Report(first_divergence=first_div, ops=records, logprobs=logprobs, settings=settings)


# ----------------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------------


def _plot(report: Report, path, title: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    layers = sorted({r.layer for r in report.ops if r.layer is not None})
    seen_layer = False
    pre, post = [], []
    for r in sorted(report.ops, key=lambda r: r.order):
        if r.layer is not None:
            seen_layer = True
        elif r.op != "model":
            (post if seen_layer else pre).append(r)
    columns = ["embed"] + [f"L{i}" for i in layers] + ["head"]
    row_names: list[str] = [r.name for r in pre]
    for r in sorted(report.ops, key=lambda r: r.order):
        if r.layer is not None and r.name not in row_names:
            row_names.append(r.name)
    row_names += [r.name for r in post if r.name not in row_names]
    grid = [[math.nan] * len(columns) for _ in row_names]
    ran = [[False] * len(columns) for _ in row_names]
    for r in report.ops:
        if r.op == "model":
            continue
        col = 0 if r in pre else (len(columns) - 1 if r in post else 1 + layers.index(r.layer))
        row = row_names.index(r.name)
        if r.sides == "both":
            grid[row][col] = r.max_abs
            ran[row][col] = True
    values = [v for line in grid for v in line if not math.isnan(v) and v > 0 and math.isfinite(v)]
    vmin = min(values) if values else 1e-8
    vmax = max(values) if values else 1.0
    vmax = max(vmax, vmin * 10)
    big = max(vmax * 10, 1.0)
    import numpy as np

    data = np.where(np.isinf(np.array(grid, dtype=float)), big, np.array(grid, dtype=float))
    masked = np.ma.masked_where(~(data > 0), data)
    fig_h = 1.2 + 0.22 * len(row_names)
    fig_w = 3.2 + 0.7 * len(columns)
    fig, ax = plt.subplots(figsize=(min(fig_w, 16), min(fig_h, 14)), dpi=80)
    cmap = plt.get_cmap("viridis").with_extremes(over="red")
    ran_arr = np.array(ran)
    zero = np.ma.masked_where(~(ran_arr & (np.nan_to_num(data) == 0)), np.ones_like(data))
    absent = np.ma.masked_where(ran_arr, np.ones_like(data))
    ax.imshow(absent, cmap=matplotlib.colors.ListedColormap(["#d9d9d9"]), aspect="auto", interpolation="nearest")
    ax.imshow(zero, cmap=matplotlib.colors.ListedColormap(["white"]), aspect="auto", interpolation="nearest")
    im = ax.imshow(
        masked, cmap=cmap, norm=LogNorm(vmin=vmin, vmax=vmax), aspect="auto", interpolation="nearest"
    )
    ax.set_xticks(range(len(columns)))
    ax.set_xticklabels(columns, fontsize=7)
    ax.set_yticks(range(len(row_names)))
    ax.set_yticklabels(row_names, fontsize=7)
    if len(columns) <= 12:  # small grids: print the values
        middle = math.sqrt(vmin * vmax)
        for i in range(len(row_names)):
            for j in range(len(columns)):
                if not ran[i][j]:
                    continue
                value = data[i][j]
                if value == 0:
                    ax.text(j, i, "0", ha="center", va="center", fontsize=6, color="#888888")
                else:
                    text = "inf" if value >= big else f"{value:.1e}"
                    color = "white" if value < middle else "black"
                    ax.text(j, i, text, ha="center", va="center", fontsize=5.5, color=color)
    bar = fig.colorbar(im, ax=ax, extend="max")
    bar.set_label("max |Δ| (log; red: non-finite on one side)", fontsize=7)
    bar.ax.tick_params(labelsize=6)
    d = report.first_divergence
    if d is not None:
        rec = next((r for r in report.ops if r.op == d.op), None)
        if rec is not None and rec.op != "model":
            col = 0 if rec in pre else (len(columns) - 1 if rec in post else 1 + layers.index(rec.layer))
            ax.add_patch(Rectangle((col - 0.5, row_names.index(rec.name) - 0.5), 1, 1, fill=False, ec="red", lw=2))
    s = report.settings
    kernels = "consistent" if s["deterministic"] else "default"
    head = title or f"training vs rollout, {s.get('model', '')} {s['dtype']}, kernels {kernels}"
    sub = "no divergence" if d is None else f"first: {d.op} ({d.category})"
    ax.set_title(f"{head}\n{sub}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Fault injection (demos and tests): plant a known inconsistency in ONE model copy
# ----------------------------------------------------------------------------------------------

FAULTS = {
    "eps": "RMSNorm eps of layers.L.post_attention_layernorm set to 1e-2 (expect: implementation)",
    "weight": "one element of layers.L.self_attn.v_proj.weight perturbed (expect: weights)",
    "bf16-softmax": "attention of layer L accumulates its softmax (probabilities, PV sums, denominator) in bf16, "
    "via an attention implementation registered for that layer only (expect: implementation)",
    "additive-mask": "attention of layer L masks with an additive -1e9 instead of selection, over a KV buffer whose "
    "unwritten slots hold garbage (NaN), like an uninitialised paged cache (expect: implementation, non-finite)",
    "kv-garbage": "control, not a fault: the same garbage KV buffer with the selection mask of the consistent kernel "
    "(expect: no divergence)",
    "router-tiebreak": "MoE router of layer L breaks top-k ties towards the higher expert index: the top-k kernel is "
    "swapped underneath an unchanged module (expect: operator); needs ties, see make_router_ties",
}
_NEEDS_CONSISTENT = {"bf16-softmax", "additive-mask", "kv-garbage", "router-tiebreak"}


def _layer_module(model: nn.Module, layer: int) -> nn.Module:
    layers = model.get_submodule("model.layers")
    if not -len(layers) <= layer < len(layers):
        raise ValueError(f"layer {layer} out of range: the model has {len(layers)} layers")
    return layers[layer]


def _install_attention_variant(model: nn.Module, layer: int, variant: str, fault: ops.Fault) -> str:
    """Give layer ``layer``'s attention its own config whose ``_attn_implementation`` names the
    consistent attention run with ``fault``'s switches on (registered in transformers' AttentionInterface)."""
    from transformers import AttentionInterface

    def interface(module, query, key, value, attention_mask, **kwargs):
        with ops.injected(fault):  # the real kernel, with the fault's switches on for this call only
            return cm._attention_interface(module, query, key, value, attention_mask, **kwargs)

    name = f"{cm.ATTN_IMPLEMENTATION}+{variant}"
    interface.__name__ = interface.__qualname__ = f"attention_{variant.replace('-', '_')}"
    AttentionInterface.register(name, interface)
    if getattr(model.config, "_attn_implementation", None) != cm.ATTN_IMPLEMENTATION:
        model.set_attn_implementation(cm.ATTN_IMPLEMENTATION)
    attn = _layer_module(model, layer).self_attn
    config = copy.copy(attn.config)
    config._attn_implementation_internal = name
    attn.config = config
    return name


def make_router_ties(model: nn.Module, layer: int = -1, experts: tuple[int, int] = (0, 1)) -> None:
    """Zero the router rows of two experts in one layer, so their logits are both exactly 0: a tie that
    decides the top-k whenever exactly one other expert scores above 0. Apply to BOTH copies."""
    gate = getattr(getattr(_layer_module(model, layer), "mlp", None), "gate", None)
    if not isinstance(gate, nn.Module) or not hasattr(gate, "top_k"):
        raise ValueError(f"layer {layer} has no MoE router (mlp.gate): a dense model?")
    with torch.no_grad():
        gate.weight[list(experts)] = 0


def inject_fault(model: nn.Module, fault: str, layer: int = -1) -> str:
    """Plant ``fault`` (a key of :data:`FAULTS`) in ``model`` (meant for the rollout copy); returns a
    one-line description of what was changed."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose from {sorted(FAULTS)}")
    n_layers = len(model.get_submodule("model.layers"))
    layer_idx = layer % n_layers if -n_layers <= layer < n_layers else layer
    block = _layer_module(model, layer)
    prefix = f"model.layers.{layer_idx}"
    if fault == "eps":
        norm = block.post_attention_layernorm
        before = norm.variance_epsilon
        norm.variance_epsilon = 1e-2
        return f"eps: {prefix}.post_attention_layernorm.variance_epsilon {before} -> {norm.variance_epsilon}"
    if fault == "weight":
        w = block.self_attn.v_proj.weight
        with torch.no_grad():
            before = float(w[0, 0])
            w[0, 0] += max(abs(before) * 0.05, 1e-2)
            after = float(w[0, 0])
        return f"weight: {prefix}.self_attn.v_proj.weight[0, 0] {before:.6g} -> {after:.6g}"
    if fault == "bf16-softmax":
        name = _install_attention_variant(model, layer_idx, "bf16_softmax", ops.Fault(softmax_dtype=torch.bfloat16))
        return f"bf16-softmax: {prefix}.self_attn uses attention implementation {name!r} (softmax accumulated in bf16)"
    if fault == "additive-mask":
        name = _install_attention_variant(
            model, layer_idx, "additive_mask", ops.Fault(additive_mask=True, kv_garbage=True)
        )
        return (
            f"additive-mask: {prefix}.self_attn uses {name!r} (additive -1e9 mask, values not selected, unwritten KV "
            "slots hold NaN garbage)"
        )
    if fault == "kv-garbage":
        name = _install_attention_variant(model, layer_idx, "kv_garbage", ops.Fault(kv_garbage=True))
        return (
            f"kv-garbage (control): {prefix}.self_attn uses {name!r} (NaN garbage in unwritten KV slots, "
            "selection mask)"
        )
    if fault == "router-tiebreak":
        mlp = getattr(block, "mlp", None)
        gate = getattr(mlp, "gate", None)
        if not isinstance(gate, nn.Module) or not hasattr(gate, "top_k"):
            raise ValueError(f"{prefix}.mlp has no MoE router (mlp.gate): a dense model?")
        state = {}

        def swap_in(module, args):  # the real top-k kernel, its tie-break switch flipped for this gate
            state["previous"] = ops.set_fault(ops.Fault(router_ties_to_higher=True))

        def swap_out(module, args, output):
            if "previous" in state:
                ops.set_fault(state.pop("previous"))

        gate.register_forward_pre_hook(swap_in)
        gate.register_forward_hook(swap_out, always_call=True)  # restored even if the forward raises
        return f"router-tiebreak: {prefix}.mlp.gate's top-k kernel breaks ties towards the higher expert index"
    raise AssertionError(fault)
