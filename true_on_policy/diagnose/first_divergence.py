"""Residual-logdiff diagnosis: the first op where the training and the rollout paths diverge.

:func:`diagnose` runs the same token sequences through the training path (one right-padded batch)
and the rollout path (prefill, then teacher-forced decode over per-request KV caches, continuous
batching), captures every module's (and a few pseudo-ops': rope, attention, top-k, combine,
log-softmax) inputs and outputs per ``(sequence, position)``, and names the first op whose inputs
are bitwise equal while its outputs differ, at the earliest differing position, classified as
``parallel``, ``weights``, ``implementation`` or ``operator``. The rules and the report are
documented in docs/diagnose.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import nn

from true_on_policy.diagnose.capture import _Side, _is_ancestor, _kind, _layer_of, _short_name
from true_on_policy.diagnose.compare import _OpStats, _classify, _compare, _rows_absdiff, _rows_equal, _suggest
from true_on_policy.diagnose.report import Divergence, OpRecord, Report
from true_on_policy.kernels import ops
from true_on_policy.rollout.packed_forward import KVCache, forward_packed
from true_on_policy.transformers_adapter.forwards import convert_model, patch_transformers
from true_on_policy.transformers_adapter.training_attention import ATTN_IMPLEMENTATION


@dataclasses.dataclass
class _Batch:
    """The requests, and the same tokens as one right-padded training batch ``[B, T]``."""

    sequences: list[list[int]]
    prompt_lengths: list[int]
    ids: torch.Tensor  # [B, T] token ids, padded with the pad token
    mask: torch.Tensor  # [B, T] 1 on the sequences' tokens
    positions: torch.Tensor  # [B, T]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.ids.shape)

    @property
    def valid(self) -> torch.Tensor:
        """[B*T] True on the sequences' tokens (the rows a capture is compared on)."""
        return self.mask.bool().reshape(-1)


@dataclasses.dataclass
class _Training:
    """The training side after its one forward: the hooks' state and the captures, on the CPU."""

    side: _Side
    captures: dict[str, tuple[dict, dict]]  # op -> (inputs, outputs), token rows of the padded batch
    log_softmax: torch.Tensor  # [B*T, V]


@dataclasses.dataclass
class _Rollout:
    """The rollout side after all its calls: per-op comparison with the training captures."""

    side: _Side
    stats: dict[str, _OpStats]
    log_softmax: torch.Tensor  # [B*T, V], rows of the padded training batch
    calls: int  # forward_packed calls


def _prepare(model: nn.Module, deterministic: bool) -> None:
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if deterministic:
        convert_model(model)


def _log_softmax(logits: torch.Tensor, deterministic: bool) -> torch.Tensor:
    if deterministic:
        return ops.log_softmax(logits)
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def _batch(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], pad_token_id: int) -> _Batch:
    """Validate the requests (a bad one raises ValueError naming it) and pad them into one batch."""
    sequences = [list(map(int, s)) for s in sequences]
    prompt_lengths = [int(p) for p in prompt_lengths]
    if not sequences:
        raise ValueError("diagnose: no sequences")
    if len(prompt_lengths) != len(sequences):
        raise ValueError(f"diagnose: {len(prompt_lengths)} prompt lengths for {len(sequences)} sequences")
    for i, (s, p) in enumerate(zip(sequences, prompt_lengths)):
        if not 1 <= p <= len(s):
            raise ValueError(f"diagnose: sequence {i} has {len(s)} tokens, prompt length {p} is not in [1, {len(s)}]")
    B, T = len(sequences), max(len(s) for s in sequences)
    ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, s in enumerate(sequences):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
    positions = torch.arange(T)[None].expand(B, T).contiguous()
    return _Batch(sequences, prompt_lengths, ids, mask, positions)


def _run_training(model: nn.Module, batch: _Batch, deterministic: bool) -> _Training:
    """One padded forward with every op captured; the captures copied to the CPU."""
    device = model.get_input_embeddings().weight.device
    side = _Side(model, "training")
    with ops.consistent(deterministic), side.hooked():
        side.begin(batch.shape)
        logits = model(
            input_ids=batch.ids.to(device),
            attention_mask=batch.mask.to(device),
            position_ids=batch.positions.to(device),
            use_cache=False,
        ).logits
        lsm = _log_softmax(logits, deterministic)
        side.record("log_softmax", {"logits": logits}, {"out": lsm})

    def keep(tensors: dict) -> dict:
        return {k: v.detach().cpu().clone() for k, v in tensors.items()}

    captures = {op: (keep(ins), keep(outs)) for op, (ins, outs) in side.captures.items()}
    side.captures = {}
    return _Training(side, captures, captures["log_softmax"][1]["out"])


def _run_rollout(model: nn.Module, batch: _Batch, training: _Training, deterministic: bool) -> _Rollout:
    """Prefill + teacher-forced decode over KV caches, continuous batching; each call's captures are
    compared with the training rows of the same tokens as they come (so only one call is held)."""
    sequences, prompt_lengths = batch.sequences, batch.prompt_lengths
    B, T = batch.shape
    device = model.get_input_embeddings().weight.device
    side = _Side(model, "rollout")
    stats: dict[str, _OpStats] = {}
    roll_lsm = torch.zeros_like(training.log_softmax)
    caches = [KVCache() for _ in sequences]
    done = [0] * B
    calls = 0
    with ops.consistent(deterministic), side.hooked():
        while any(d < len(s) for d, s in zip(done, sequences)):
            segments = []
            for i, s in enumerate(sequences):
                if done[i] < len(s):
                    segments.append((i, prompt_lengths[i] if done[i] == 0 else 1))
            seg_ids = torch.cat([torch.tensor(sequences[i][done[i] : done[i] + n]) for i, n in segments])
            seg_pos = torch.cat([torch.arange(done[i], done[i] + n) for i, n in segments])
            index = torch.cat([i * T + torch.arange(done[i], done[i] + n) for i, n in segments])
            side.begin((1, int(seg_ids.numel())))
            out = forward_packed(
                model,
                seg_ids.to(device),
                seg_pos.to(device),
                [n for _, n in segments],
                [caches[i] for i, _ in segments],
            )
            lsm = _log_softmax(out[None], deterministic)
            side.record("log_softmax", {"logits": out[None]}, {"out": lsm})
            roll_lsm[index] = lsm.reshape(-1, lsm.shape[-1]).cpu().to(roll_lsm.dtype)
            for op, capture in side.captures.items():
                if op not in training.captures:
                    continue
                if op not in stats:
                    stats[op] = _OpStats(B * T)
                _compare(training.captures[op], capture, index, stats[op])
            side.captures = {}
            for i, n in segments:
                done[i] += n
            calls += 1
    return _Rollout(side, stats, roll_lsm, calls)


def _op_record(op: str, order: int, sides: str, stats: _OpStats | None, batch: _Batch) -> OpRecord:
    """The table row of one op: its |Δ| over the compared tokens, the first differing token."""
    named = dict(op=op, layer=_layer_of(op), name=_short_name(op), kind=_kind(op), order=order, sides=sides)
    if stats is None:
        return OpRecord(**named)
    B, T = batch.shape
    seen = stats.seen & batch.valid
    differ = seen & ~stats.out_eq
    first = None
    if bool(differ.any()):
        g = torch.nonzero(differ).flatten()
        g0 = int(g[torch.argmin(g % T * B + g // T)])  # earliest position, then lowest sequence
        first = (g0 // T, g0 % T)
    numel = float(stats.numel[seen].sum())
    return OpRecord(
        **named,
        tokens=int(seen.sum()),
        tokens_differing=int(differ.sum()),
        max_abs=float(stats.max_abs[seen].max()) if bool(seen.any()) else 0.0,
        mean_abs=float(stats.sum_abs[seen].sum()) / numel if numel else 0.0,
        first_diff=first,
        inputs_differing=int((seen & ~stats.in_eq).sum()),
    )


def _records(training: _Training, rollout: _Rollout, batch: _Batch) -> list[OpRecord]:
    """One row per op, in the training side's execution order; rollout-only ops last."""
    t_order, r_order = training.side.order, rollout.side.order
    ops_ = sorted(t_order, key=t_order.get) + [op for op in sorted(r_order, key=r_order.get) if op not in t_order]
    records = []
    for op in ops_:
        order = t_order.get(op, len(t_order) + r_order.get(op, 0))
        stats = rollout.stats.get(op)
        if stats is not None:
            sides = "both"
        elif op in t_order:
            sides = "both" if op in r_order else "training"
        else:
            sides = "rollout"
        records.append(_op_record(op, order, sides, stats, batch))
    return records


def _first_at(position: int, differing: list[OpRecord], stats: dict[str, _OpStats], batch: _Batch):
    """``(record, sequence, inputs_equal)`` of the first divergence at ``position``: over the sequences
    that differ there, the earliest op with equal inputs and differing outputs (none of whose
    descendants qualifies); only where there is none, the earliest differing op."""
    T = batch.shape[1]
    # every sequence with a difference at the position (not only the one each op saw first)
    tokens = sorted(
        {
            s
            for s in range(len(batch.sequences))
            for r in differing
            if position < len(batch.sequences[s]) and not bool(stats[r.op].out_eq[s * T + position])
        }
    )
    best = None
    for s in tokens:
        g = s * T + position
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
    return best[1:]


def _first_divergence(
    records: list[OpRecord], training: _Training, rollout: _Rollout, batch: _Batch
) -> Divergence | None:
    """The first divergence over all tokens (earliest position first), classified, with its fix."""
    differing = [r for r in records if r.sides == "both" and r.tokens_differing]
    if not differing:
        return None
    position = min(r.first_diff[1] for r in differing)
    r, s, inputs_equal = _first_at(position, differing, rollout.stats, batch)
    max_abs = float(rollout.stats[r.op].max_abs[s * batch.shape[1] + position])
    owner = training.side.owner.get(r.op)
    category, details = _classify(
        r.op, r.kind, owner, training.side.model, rollout.side.model, training.side, rollout.side
    )
    nonfinite = math.isinf(max_abs)  # non-finite on one side only (or shapes)
    if nonfinite:
        details = details + ["outputs are non-finite (NaN/inf) on one side only"]
    fix = _suggest(category, r.kind, [d for d in details if "non-finite" not in d], nonfinite)
    return Divergence(
        layer=r.layer,
        op=r.op,
        category=category,
        fix=fix,
        kind=r.kind,
        sequence=s,
        position=position,
        max_abs_diff=max_abs,
        inputs_equal=inputs_equal,
        details=details,
    )


def _logprob_diff(training: _Training, rollout: _Rollout, batch: _Batch) -> dict:
    """|Δ| of the response tokens' log-probs between the two sides."""
    T = batch.shape[1]
    lp_t, lp_r = [], []
    for b, (s, p) in enumerate(zip(batch.sequences, batch.prompt_lengths)):
        if len(s) > p:
            rows = torch.arange(p - 1, len(s) - 1) + b * T
            labels = torch.tensor(s[p:])
            lp_t.append(training.log_softmax[rows].gather(-1, labels[:, None]).squeeze(-1))
            lp_r.append(rollout.log_softmax[rows].gather(-1, labels[:, None]).squeeze(-1))
    if not lp_t:
        return {"max_abs": 0.0, "mean_abs": 0.0, "equal": 0, "tokens": 0}
    a, b_ = torch.cat(lp_t), torch.cat(lp_r)
    m, sm, _ = _rows_absdiff(a[:, None], b_[:, None])
    return {
        "max_abs": float(m.max()),
        "mean_abs": float(sm.mean()),
        "equal": int(_rows_equal(a[:, None], b_[:, None]).sum()),
        "tokens": int(a.numel()),
    }


def _settings(training: _Training, rollout: _Rollout, batch: _Batch, deterministic: bool) -> dict:
    def dtype_of(model: nn.Module) -> str:
        return str(model.get_input_embeddings().weight.dtype).replace("torch.", "")

    B, T = batch.shape
    return {
        "model": type(training.side.model).__name__,
        "deterministic": bool(deterministic),
        "dtype": dtype_of(training.side.model),
        "rollout_dtype": dtype_of(rollout.side.model),
        "sequences": B,
        "tokens": int(batch.valid.sum()),
        "prompt_lengths": batch.prompt_lengths,
        "sequence_lengths": [len(s) for s in batch.sequences],
        "training_batch": [B, T],
        "rollout_calls": rollout.calls,
    }


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
    both models are switched to ``attn_implementation="consistent"`` and, when
    ``deterministic``, their linears are converted (:func:`true_on_policy.transformers_adapter.forwards.convert_model`).
    Captures are held on the CPU: memory is about one padded training batch of activations for
    every op (keep sequences few and short for a large model).
    """
    if pad_token_id is None:
        pad_token_id = getattr(training_model.config, "pad_token_id", None) or 0
    batch = _batch(sequences, prompt_lengths, pad_token_id)
    patch_transformers()
    for model in (training_model, rollout_model):
        _prepare(model, deterministic)
    training = _run_training(training_model, batch, deterministic)
    rollout = _run_rollout(rollout_model, batch, training, deterministic)
    records = _records(training, rollout, batch)
    return Report(
        first_divergence=_first_divergence(records, training, rollout, batch),
        ops=records,
        logprobs=_logprob_diff(training, rollout, batch),
        settings=_settings(training, rollout, batch, deterministic),
    )
