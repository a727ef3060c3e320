"""Cost of the consistent kernels: flag on vs off, in one run, as ratios (CPU, tiny Qwen3 dense / MoE).

Cases (each for the dense and the MoE tiny model, in fp32 and bf16):

* ``decode_b{B}_c{C}``: one :func:`consistent_model.forward_packed` decode step for B requests whose
  KV caches hold between C/2 and C-1 tokens (ragged). "off" is the same call with the flag off
  (one batched SDPA over the padded batch, a serving engine's default).
* ``train_padded``: forward + backward of a [4, 512] batch with an attention mask
  (use_remove_padding=False); "off" is transformers' ``attn_implementation="sdpa"`` (a fused causal
  kernel) on the same weights with the default ops.
* ``train_packed``: the same tokens as [1, 4*512] with position_ids restarting at 0 (verl's
  use_remove_padding layout); "off" as above (SDPA attends over the whole packed row).

The two variants alternate within a repeat, so load changes hit both; the machine may be shared, so
each record carries the median and the minimum over the repeats (ms) and ``ratio`` = median on /
median off (``ratio_min`` from the minima).
With ``--threads 1 --clock cpu`` the times are the calling thread's CPU time: on a machine shared with
other jobs they do not count the time the thread waits for a core.
Usage: python benchmarks/bench_consistent_kernels.py [--json] [--repeats N] [--threads N] [--clock wall|cpu]
       [--cases SUBSTR ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from true_on_policy.rollout.packed_forward import KVCache, forward_packed
from true_on_policy.transformers_adapter.forwards import patch_transformers
from true_on_policy.transformers_adapter.training_attention import ATTN_IMPLEMENTATION
from true_on_policy.kernels import ops
from true_on_policy.tiny_assets import tiny_model_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DECODE_SHAPES = ((1, 64), (8, 256), (32, 1024))  # (requests, cache tokens)


def build(kind: str, attn: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_model_config(kind), attn_implementation=attn)
    return model.to(dtype)


def timed(on, off, repeats: int, clock=time.perf_counter) -> dict:
    """Median and minimum time of each (ms), the two interleaved so that load changes hit both."""
    on(), off()  # warm-up
    times = ([], [])
    for i in range(repeats):
        order = ((on, times[0]), (off, times[1])) if i % 2 == 0 else ((off, times[1]), (on, times[0]))
        for fn, bucket in order:
            start = clock()
            fn()
            bucket.append((clock() - start) * 1e3)
    on_med, off_med = statistics.median(times[0]), statistics.median(times[1])
    on_min, off_min = min(times[0]), min(times[1])
    return dict(
        on_ms=round(on_med, 3),
        off_ms=round(off_med, 3),
        ratio=round(on_med / off_med, 3),
        on_min_ms=round(on_min, 3),
        off_min_ms=round(off_min, 3),
        ratio_min=round(on_min / off_min, 3),
        repeats=repeats,
    )


def train_step(model, flag: bool, batch: int, length: int, packed: bool):
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
            if flag:
                loss = -ops.token_log_probs(logits, labels).mean()
            else:
                loss = -torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).mean()
            loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def decode_step(model, flag: bool, batch: int, cache_len: int):
    g = torch.Generator().manual_seed(1)
    model.eval()
    lens = [cache_len - 1 - (i * cache_len) // (2 * batch) for i in range(batch)]  # ragged, < cache_len
    with ops.consistent(flag):
        caches = [KVCache() for _ in range(batch)]
        ids = torch.randint(3, model.config.vocab_size, (sum(lens),), generator=g)
        pos = torch.cat([torch.arange(n) for n in lens])
        forward_packed(model, ids, pos, lens, caches)
    step_ids = torch.randint(3, model.config.vocab_size, (batch,), generator=g)
    positions = torch.tensor(lens)

    def step():
        with ops.consistent(flag):
            forward_packed(model, step_ids, positions, [1] * batch, caches)
        for c, n in zip(caches, lens):  # drop the new token again: every repeat decodes the same step
            c.truncate(n)

    return step


def cases(args):
    """(name, make) pairs; make() builds the models and returns (on, off, repeats)."""
    for kind in ("dense", "moe"):
        for dname, dtype in DTYPES.items():
            for b, c in DECODE_SHAPES:

                def make_decode(kind=kind, dtype=dtype, b=b, c=c):
                    model = build(kind, ATTN_IMPLEMENTATION, dtype)
                    return decode_step(model, True, b, c), decode_step(model, False, b, c), 5 * args.repeats

                yield f"decode_b{b}_c{c}/{kind}/{dname}", make_decode
            for packed in (False, True):

                def make_train(kind=kind, dtype=dtype, packed=packed):
                    consistent = build(kind, ATTN_IMPLEMENTATION, dtype)
                    default = build(kind, "sdpa", dtype)
                    default.load_state_dict(consistent.state_dict())
                    return (
                        train_step(consistent, True, args.batch, args.length, packed),
                        train_step(default, False, args.batch, args.length, packed),
                        args.repeats,
                    )

                yield f"{'train_packed' if packed else 'train_padded'}/{kind}/{dname}", make_train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true", help="one JSON record per line")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--cases", nargs="*", default=None, help="run only cases whose name contains one of these")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the calling thread's CPU time (needs --threads 1); robust to other jobs on a shared machine",
    )
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error(f"--clock cpu measures one thread; it needs --threads 1, got --threads {args.threads}")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    patch_transformers()
    records = []
    for name, make in cases(args):
        if args.cases and not any(sub in name for sub in args.cases):
            continue
        on, off, repeats = make()
        record = dict(case=name, threads=torch.get_num_threads(), clock=args.clock, **timed(on, off, repeats, clock))
        records.append(record)
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(f"{name:32s} on {record['on_ms']:9.3f} ms  off {record['off_ms']:9.3f} ms  ratio {record['ratio']:.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
