"""Device check: training forward vs incremental decode with the project's kernels, on one device.

For a random tiny Qwen3 (dense) and Qwen3-MoE in ``--dtype`` (bf16 by default), built locally from
``true_on_policy.tiny_assets`` configs (nothing is downloaded), with the consistent kernels on and off:

1. rollout: ``--prompts`` prompts of spread lengths are prefilled together, then decoded
   ``--new-tokens`` steps with a per-request KV cache (``rollout.packed_forward.forward_packed``), greedy;
   the log-prob of every chosen token is recorded from the distribution it was chosen from;
2. training: the same sequences scored in verl's packed layout (one row, restarting positions) in
   reversed micro-batches of ``--micro-batch`` sequences, then the log-prob of each generated token;
3. logdiff: max/mean |rollout - training| and the fraction of bitwise-equal tokens (``torch.equal``
   decides ``max_abs_diff == 0``).

It also times flag on vs off, interleaved, for the packed training forward and for the decode loop,
and reports ``ratio = on / off``. Output: one JSON list (``--json PATH`` or stdout), records with
``case``. Needs torch and transformers only (no vLLM, no verl).

    python benchmarks/device_check.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from true_on_policy import tiny_assets
from true_on_policy.rollout.packed_forward import KVCache, forward_packed
from true_on_policy.transformers_adapter.forwards import patch_transformers
from true_on_policy.kernels import ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def prompt_lengths(count: int, longest: int) -> list[int]:
    if count == 1:
        return [longest]
    return [1 + round(i * (longest - 1) / (count - 1)) for i in range(count)]


def make_prompts(count: int, longest: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    low = len(tiny_assets.SPECIAL_TOKENS)
    return [torch.randint(low, vocab_size, (n,), generator=generator).tolist() for n in prompt_lengths(count, longest)]


def build(kind: str, dtype: torch.dtype, device: str):
    return tiny_assets.build_model(kind).to(device=device, dtype=dtype)


@torch.no_grad()
def decode(model, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy incremental decode of all prompts together; (generated tokens, their log-probs) per prompt."""
    caches = [KVCache() for _ in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    recorded: list[list[torch.Tensor]] = [[] for _ in prompts]
    feed = [list(p) for p in prompts]
    for _ in range(new_tokens):
        lens = [len(f) for f in feed]
        ids = torch.tensor([t for f in feed for t in f], device=device)
        positions = torch.cat([torch.arange(c.length, c.length + n) for c, n in zip(caches, lens)]).to(device)
        last = torch.cumsum(torch.tensor(lens, device=device), 0) - 1
        rows = forward_packed(model, ids, positions, lens, caches, logits_rows=last)
        chosen = rows.float().argmax(dim=-1)
        log_probs = ops.token_log_probs(rows, chosen)
        for i in range(len(prompts)):
            generated[i].append(int(chosen[i]))
            recorded[i].append(log_probs[i : i + 1])
        feed = [[g[-1]] for g in generated]
    return generated, [torch.cat(r) for r in recorded]


@torch.no_grad()
def score(model, sequences: list[list[int]], prompt_lens: list[int], micro_batch: int, device: str) -> list[torch.Tensor]:
    """Training-side log-probs of the generated tokens: packed rows, reversed micro-batches."""
    order = list(reversed(range(len(sequences))))
    scores: dict[int, torch.Tensor] = {}
    for start in range(0, len(order), micro_batch):
        group = order[start : start + micro_batch]
        ids = torch.tensor([t for i in group for t in sequences[i]], device=device)
        positions = torch.cat([torch.arange(len(sequences[i])) for i in group]).to(device)
        logits = forward_packed(model, ids, positions, [len(sequences[i]) for i in group], None)
        offset = 0
        for i in group:
            n, p = len(sequences[i]), prompt_lens[i]
            labels = torch.tensor(sequences[i][p:], device=device)
            scores[i] = ops.token_log_probs(logits[offset + p - 1 : offset + n - 1], labels)
            offset += n
    return [scores[i] for i in range(len(sequences))]


def _with_flag(flag: bool, fn):
    with ops.consistent(flag):
        return fn()


def logdiff(kind: str, dtype: str, flag: bool, args) -> dict:
    def run():
        model = build(kind, DTYPES[dtype], args.device)
        prompts = make_prompts(args.prompts, args.longest, model.config.vocab_size)
        generated, recorded = decode(model, prompts, args.new_tokens, args.device)
        sequences = [p + g for p, g in zip(prompts, generated)]
        trained = score(model, sequences, [len(p) for p in prompts], args.micro_batch, args.device)
        return torch.cat(recorded), torch.cat(trained)

    recorded, trained = _with_flag(flag, run)
    trained = trained.to(recorded.dtype)
    diff = (recorded.float() - trained.float()).abs()
    return {
        "case": f"logdiff/{kind}/{dtype}",
        "deterministic": flag,
        "max_abs_diff": 0.0 if torch.equal(recorded, trained) else float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "frac_equal": float((recorded == trained).float().mean()),
        "tokens": int(recorded.numel()),
        "device": args.device,
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(device: str, fn) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def overhead(kind: str, dtype: str, args) -> list[dict]:
    """Flag on vs off, interleaved, minimum over repeats: packed training forward and decode loop."""
    model = build(kind, DTYPES[dtype], args.device)
    prompts = make_prompts(args.prompts, args.longest, model.config.vocab_size)
    sequences = [p + p[: args.new_tokens] for p in prompts]
    cases = {
        "train_forward": lambda: score(model, sequences, [len(p) for p in prompts], len(sequences), args.device),
        "decode": lambda: decode(model, prompts, args.new_tokens, args.device),
    }
    records = []
    for name, fn in cases.items():
        times = {True: [], False: []}
        for flag in (True, False):  # warm-up (compilation, allocator)
            _with_flag(flag, fn)
        for _ in range(args.repeats):
            for flag in (True, False):
                times[flag].append(_timed(args.device, lambda: _with_flag(flag, fn)))
        on, off = min(times[True]) * 1e3, min(times[False]) * 1e3
        records.append(
            {"case": f"overhead/{name}/{kind}/{dtype}", "on_ms": on, "off_ms": off, "ratio": on / off, "device": args.device}
        )
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--models", nargs="+", default=list(tiny_assets.MODEL_KINDS), choices=tiny_assets.MODEL_KINDS)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--longest", type=int, default=200, help="longest prompt (lengths spread over 1..longest)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the records here (default: stdout)")
    args = parser.parse_args(argv)
    if min(args.prompts, args.longest, args.new_tokens, args.micro_batch, args.repeats) < 1:
        parser.error("--prompts, --longest, --new-tokens, --micro-batch and --repeats must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch.cuda.is_available() is False")
    patch_transformers()
    meta = {
        "case": "environment",
        "torch": torch.__version__,
        "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
    }
    records = [meta]
    for kind in args.models:
        for flag in (True, False):
            records.append(logdiff(kind, args.dtype, flag, args))
        records += overhead(kind, args.dtype, args)
    text = json.dumps(records, indent=1)
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
