"""Cost of the consistent kernels: flag on vs off, in one run, as ratios (CPU, tiny Qwen3 dense).

* train: forward + backward of a packed batch (verl's use_remove_padding layout: [1, B*T] with
  position_ids restarting at 0), batch 4 x seq 512. "off" is the default engine path: the same
  weights with transformers' own ``attn_implementation="sdpa"``.
* train_padded: the same batch as [4, 512] with an attention mask (use_remove_padding=False);
  there transformers' SDPA runs a plain causal kernel.
* decode: one :func:`consistent_model.forward_packed` step for 8 requests, each with a ~256-token
  KV cache. "off" is the same call with the flag off (per-request SDPA against its cache).

Times are the minimum over interleaved repeats (the machine is shared; minima are the least
noisy), in ms.
Usage: python benchmarks/bench_consistent_kernels.py [--repeats N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from true_on_policy.kernels import model as cm
from true_on_policy.kernels import ops
from true_on_policy.tiny_assets import tiny_model_config


def build(attn: str):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_model_config("dense"), attn_implementation=attn)


def best_ms(on, off, repeats: int) -> tuple[float, float]:
    """Minimum wall time of each, in ms, the two interleaved so that load changes hit both."""
    on(), off()  # warm-up
    times = ([], [])
    for _ in range(repeats):
        for fn, bucket in zip((on, off), times):
            start = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - start)
    return min(times[0]) * 1e3, min(times[1]) * 1e3


def train_step(model, flag: bool, batch: int, length: int, packed: bool = True):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, batch * length), generator=g)
    pos = torch.arange(length).repeat(batch)[None]
    labels = torch.roll(ids[0], -1)
    if packed:
        inputs = dict(input_ids=ids, position_ids=pos)
    else:
        inputs = dict(
            input_ids=ids.view(batch, length),
            position_ids=pos.view(batch, length),
            attention_mask=torch.ones(batch, length, dtype=torch.long),
        )
    model.train()

    def step():
        with ops.consistent(flag):
            logits = model(**inputs, use_cache=False).logits.reshape(batch * length, -1)
            loss = -ops.token_log_probs(logits, labels).mean() if flag else -torch.log_softmax(
                logits.float(), -1
            ).gather(-1, labels[:, None]).mean()
            loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def decode_step(model, flag: bool, batch: int, cache_len: int):
    g = torch.Generator().manual_seed(1)
    model.eval()
    with ops.consistent(flag):
        caches = [cm.KVCache() for _ in range(batch)]
        lens = [cache_len - i for i in range(batch)]  # ragged, around cache_len
        ids = torch.randint(3, model.config.vocab_size, (sum(lens),), generator=g)
        pos = torch.cat([torch.arange(n) for n in lens])
        cm.forward_packed(model, ids, pos, lens, caches)
        step_ids = torch.randint(3, model.config.vocab_size, (batch,), generator=g)

    def step():
        with ops.consistent(flag):
            positions = torch.tensor([c.length for c in caches])
            cm.forward_packed(model, step_ids, positions, [1] * batch, caches)

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--cache", type=int, default=256)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cm.patch_transformers()
    consistent = build(cm.ATTN_IMPLEMENTATION)
    default = build("sdpa")
    default.load_state_dict(consistent.state_dict())

    train_on, train_off = best_ms(
        train_step(consistent, True, args.batch, args.length),
        train_step(default, False, args.batch, args.length),
        args.repeats,
    )
    padded_on, padded_off = best_ms(
        train_step(consistent, True, args.batch, args.length, packed=False),
        train_step(default, False, args.batch, args.length, packed=False),
        args.repeats,
    )
    decode_on, decode_off = best_ms(
        decode_step(consistent, True, args.decode_batch, args.cache),
        decode_step(consistent, False, args.decode_batch, args.cache),
        args.repeats * 5,
    )
    print(
        json.dumps(
            {
                "threads": torch.get_num_threads(),
                "train_fwd_bwd": {
                    "batch": args.batch,
                    "seq_len": args.length,
                    "on_ms": round(train_on, 2),
                    "off_ms": round(train_off, 2),
                    "ratio": round(train_on / train_off, 3),
                },
                "train_fwd_bwd_padded": {
                    "batch": args.batch,
                    "seq_len": args.length,
                    "on_ms": round(padded_on, 2),
                    "off_ms": round(padded_off, 2),
                    "ratio": round(padded_on / padded_off, 3),
                },
                "decode_step": {
                    "batch": args.decode_batch,
                    "cache_len": args.cache,
                    "on_ms": round(decode_on, 3),
                    "off_ms": round(decode_off, 3),
                    "ratio": round(decode_on / decode_off, 3),
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
