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

import math
from collections.abc import Sequence

import torch
from torch import nn

from true_on_policy.diagnose.capture import _Side, _is_ancestor, _kind, _layer_of, _short_name
from true_on_policy.diagnose.compare import _OpStats, _classify, _compare, _rows_absdiff, _rows_equal, _suggest
from true_on_policy.diagnose.report import Divergence, OpRecord, Report
from true_on_policy.kernels.model import ATTN_IMPLEMENTATION, KVCache, convert_model, forward_packed, patch_transformers
from true_on_policy.kernels import ops


def _prepare(model: nn.Module, deterministic: bool) -> None:
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if deterministic:
        convert_model(model)


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
    both models are switched to ``attn_implementation="consistent"`` and, when
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
    patch_transformers()
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
    caches = [KVCache() for _ in sequences]
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
            out = forward_packed(
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

