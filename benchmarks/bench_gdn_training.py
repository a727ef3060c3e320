"""Training cost of the consistent Gated DeltaNet: peak memory and time of one forward + backward, flag on vs stock.

The model: a hidden-1024 Qwen3.5 built here from a transformers config (the shipped tiny model's vocabulary and
special ids; Qwen3.5's GDN head shape: 16 value / 8 key heads of 128; 3 Gated DeltaNet + 1 gated attention
layers, attention 8 query / 2 KV heads of 256), ``dense`` or ``moe`` (16 experts, top 4, with a shared
expert), fp32, weights from seed 0. One sequence of T random tokens, the loss the mean token log-likelihood,
``loss.backward()``. "on": the project's consistent model (``patch_transformers``, the flag on: the GDN's
checkpointed backward); "stock": transformers' own modules (without fla, its torch chunked GDN path), SDPA.

Each case runs in its own process (a fresh interpreter: peak RSS is that case's alone), after a 16-token
warm-up step in that process (one-time costs: the native library's load, first-call dispatch); the time is
the T-token step's wall clock, the memory the process's peak RSS (``ru_maxrss``). The machine may be shared:
note its load next to the numbers.
Usage: python benchmarks/bench_gdn_training.py [T ...] [--kinds dense moe] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from true_on_policy.kernels import ops
from true_on_policy.transformers_adapter.forwards import patch_transformers
from true_on_policy.transformers_adapter.training_attention import ATTN_IMPLEMENTATION
from true_on_policy.tiny_assets import tiny_model_config

LENGTHS = (1024, 4096, 8192)
WARMUP_TOKENS = 16
# Qwen3.5's shapes at hidden 1024 (Qwen3.5-0.8B's widths): the layer order of the shipped tiny model
SIZES = dict(hidden_size=1024, head_dim=256, num_attention_heads=8, num_key_value_heads=2, linear_key_head_dim=128,
             linear_value_head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
             max_position_embeddings=16384)
DENSE_SIZES = dict(intermediate_size=3072)
MOE_SIZES = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512, shared_expert_intermediate_size=512)


def build(kind: str, path: str):
    from transformers import AutoModelForCausalLM

    config = tiny_model_config("qwen35" if kind == "dense" else "qwen35_moe")
    for name, value in {**SIZES, **(DENSE_SIZES if kind == "dense" else MOE_SIZES)}.items():
        setattr(config, name, value)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation=ATTN_IMPLEMENTATION if path == "on" else "sdpa")
    return model.train()


def step(model, path: str, length: int) -> None:
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    labels = ids[0, 1:]
    with ops.consistent(path == "on"):
        logits = model(input_ids=ids, position_ids=torch.arange(length)[None], use_cache=False).logits[0, :-1]
        if path == "on":
            loss = -ops.token_log_probs(logits, labels).mean()
        else:
            loss = -torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).mean()
        loss.backward()
    model.zero_grad(set_to_none=True)


def child(kind: str, path: str, length: int, threads: int | None) -> None:
    """One case in this process: prints one JSON record (seconds, peak RSS in bytes)."""
    if threads:
        torch.set_num_threads(threads)
    if path == "on":
        patch_transformers()
    model = build(kind, path)
    step(model, path, WARMUP_TOKENS)
    start = time.perf_counter()
    step(model, path, length)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(json.dumps(dict(kind=kind, path=path, T=length, seconds=round(seconds, 3), peak_rss=peak,
                          threads=torch.get_num_threads())), flush=True)


def run_case(kind: str, path: str, length: int, threads: int | None) -> dict:
    command = [sys.executable, __file__, "--child", kind, path, str(length)] + (["--threads", str(threads)] if threads else [])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} {path} T={length} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lengths", nargs="*", type=int, default=list(LENGTHS), help="tokens per sequence")
    parser.add_argument("--kinds", nargs="*", default=["dense", "moe"], choices=["dense", "moe"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="one JSON record per case")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "PATH", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), args.threads)
        return
    if not args.json:
        print(f"{'T':>6} {'kind':6} {'stock RSS':>10} {'on RSS':>10} {'ratio':>6} {'stock s':>9} {'on s':>9} {'ratio':>6}")
    for length in args.lengths:
        for kind in args.kinds:
            stock, on = (run_case(kind, path, length, args.threads) for path in ("stock", "on"))
            if args.json:
                print(json.dumps(stock), json.dumps(on), sep="\n", flush=True)
                continue
            print(f"{length:6d} {kind:6} {stock['peak_rss'] / 2**30:8.2f}GB {on['peak_rss'] / 2**30:8.2f}GB "
                  f"{on['peak_rss'] / stock['peak_rss']:6.2f} {stock['seconds']:9.2f} {on['seconds']:9.2f} "
                  f"{on['seconds'] / stock['seconds']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
