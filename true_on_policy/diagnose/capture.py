"""Capture: every module's (and pseudo-op's) inputs and outputs on one side, mapped to tokens.

:class:`_Side` hooks one model copy (training or rollout) and records, per op, the captured rows
with the ``(sequence, position)`` of each, so the two sides can be compared token by token; the
op-naming helpers give each capture its layer, short name and kind.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from collections.abc import Mapping

import torch
from torch import nn

from true_on_policy import patching
from true_on_policy.transformers_adapter.training_attention import ROLLOUT_KWARG
from true_on_policy.transformers_adapter import patches


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
    ROLLOUT_KWARG,
}


# The experts' combine, recorded by the capture: the models call it through the MoE module.
MOE_COMBINE = patching.Target("true_on_policy.kernels.moe", "moe_combine", ("expert_outputs", "weights"))

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


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
        modeling = {sys.modules.get(type(m).__module__) for m in root.modules()}
        try:
            wrappers = [
                patching.Patch(MOE_COMBINE, make=self._combine_wrapper),
                *patches.rotary_patches(modeling, self._rope_wrapper),
            ]
            with patching.apply(wrappers):
                yield self
        finally:
            for h in self.handles:
                h.remove()
            self.handles.clear()

    def begin(self, lead: tuple[int, int]) -> None:
        self.lead = lead
        self.captures = {}
        self.call_counts = {}
        self.stack = []

