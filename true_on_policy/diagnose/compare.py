"""Compare and classify: token-by-token differences of captured ops, and why an op diverged.

:func:`_compare` accumulates per-op |Δ| statistics and bitwise equality per row; :func:`_classify`
compares the two modules behind a divergent op (sharding, weights, configuration, or the kernel
itself) and :func:`_suggest` states the fix in terms of the four rules.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from true_on_policy.diagnose.capture import _Side, _base
from true_on_policy.diagnose.report import _fmt


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

