"""The rollout's Gated DeltaNet layer step: one C++ call vs the composed torch ops, in one run.

vLLM's consistent Qwen3.5 runs each GDN layer's step (conv, gating, l2norm, the recurrence, the gated norm for
every sequence of the step, states in vLLM's slots) as ``gated_delta.gated_delta_net_slots`` -- on CPU one
native call ("fused"). Before, the adapter gathered the slots' states, ran ``gated_delta_net_varlen`` (torch's
elementwise ops around the C++ recurrence, the sequences padded into a batch) and scattered the states back
("composed"). Both give the same bits (asserted first). Per case the two alternate within each repeat on
fresh copies of the caches; the median of ``--repeats`` is kept.

Shapes: Qwen3.5's GDN head shape (``--key-heads`` 8 / ``--value-heads`` 16 of 128, 4 conv taps), bf16.
Cases: decode (``--batch`` sequences of one token, each continuing its state), prefill (``--batch`` fresh
sequences of ``--prefill`` tokens), at batch 1 and 16.

    python benchmarks/bench_gdn_rollout_step.py [--json] [--repeats N] [--threads N]

Records: ``case``, ``tokens``, ``fused_ms``, ``composed_ms``, ``ratio`` (fused / composed; < 1: fused faster).

A mixed step (``--batch`` decodes beside one prefill chunk): the adapter's two fused calls, decodes then the
chunk (``vllm_adapter/hybrid_layers.py`` ``_gdn_step``: a device's torch code pads a call to its longest
sequence) against one call over all of them, the same bits asserted. Records ``split_ms``, ``one_call_ms``,
``ratio`` (split / one call; > 1: what the split costs on CPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from true_on_policy.kernels import gated_delta

TAPS, EPS = 4, 1e-6


def step_args(key_heads, value_heads, head_dim, lengths, fresh, dtype, seed=0):
    """The op's keyword arguments for one step of sequences of ``lengths`` tokens in slots 0..n-1."""
    g = torch.Generator().manual_seed(seed)
    channels, value_dim, total = 2 * key_heads * head_dim + value_heads * head_dim, value_heads * head_dim, sum(lengths)
    mixed_qkvz = torch.randn(total, channels + value_dim, generator=g).to(dtype)
    ba = torch.randn(total, 2 * value_heads, generator=g).to(dtype)
    n = len(lengths)
    return dict(
        mixed_qkv=mixed_qkvz[:, :channels], z=mixed_qkvz[:, channels:], b=ba[:, :value_heads], a=ba[:, value_heads:],
        cu_seqlens=torch.tensor([0, *lengths]).cumsum(0), slots=torch.arange(n), fresh=torch.full((n,), fresh),
        conv_cache=torch.randn(n, TAPS - 1, channels, generator=g).to(dtype).transpose(1, 2),
        state_cache=torch.randn(n, value_heads, head_dim, head_dim, generator=g) * 0.1,
        conv_weight=(torch.randn(channels, 1, TAPS, generator=g) * 0.5).to(dtype),
        A_log=torch.log(torch.rand(value_heads, generator=g) * 16 + 0.5).to(dtype),
        dt_bias=torch.randn(value_heads, generator=g).to(dtype),
        norm_weight=(1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype),
        head_k_dim=head_dim, head_v_dim=head_dim, eps=EPS)


def composed(args):
    """The adapter's step before the fused call (the op's specification): gather, ``gated_delta_net_varlen``,
    scatter."""
    return gated_delta.gated_delta_net_slots_torch(**args)


def fused(args):
    return gated_delta.gated_delta_net_slots(**args)


def fresh_caches(args):
    return {**args, "conv_cache": args["conv_cache"].clone(), "state_cache": args["state_cache"].clone()}


def medians_ms(variants: dict, args, repeats: int) -> dict[str, float]:
    """Each variant's median time (ms) over ``repeats``, the variants alternating within a repeat on fresh caches."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            copy = fresh_caches(args)
            start = time.perf_counter()
            run(copy)
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def same_step(first, second, args) -> bool:
    """Whether two ways of running the step give the same output and leave the same caches."""
    a, b = fresh_caches(args), fresh_caches(args)
    return torch.equal(first(a), second(b)) and all(torch.equal(a[c], b[c]) for c in ("state_cache", "conv_cache"))


def measure(args, repeats: int) -> dict:
    with torch.no_grad():
        assert same_step(fused, composed, args), "fused and composed bits differ"
        ms = medians_ms({"fused": fused, "composed": composed}, args, repeats)
    return {"fused_ms": ms["fused"], "composed_ms": ms["composed"], "ratio": ms["fused"] / ms["composed"]}


def split_calls(args, decodes: int):
    """The adapter's mixed step: the decodes' call, then the prefill chunk's, each over its own rows."""
    bounds, start = args["cu_seqlens"], int(args["cu_seqlens"][decodes])
    rows = {"mixed_qkv", "z", "b", "a"}
    parts = []
    for first, last, begin, end in ((0, decodes, 0, start), (decodes, len(bounds) - 1, start, int(bounds[-1]))):
        part = {k: (v[begin:end] if k in rows else v) for k, v in args.items()}
        part.update(cu_seqlens=bounds[first:last + 1] - begin, slots=args["slots"][first:last],
                    fresh=args["fresh"][first:last])
        parts.append(fused(part))
    return torch.cat(parts)


def measure_split(args, decodes: int, repeats: int) -> dict:
    split = functools.partial(split_calls, decodes=decodes)
    with torch.no_grad():
        assert same_step(split, fused, args), "two calls and one call differ"
        ms = medians_ms({"split": split, "one_call": fused}, args, repeats)
    return {"split_ms": ms["split"], "one_call_ms": ms["one_call"], "ratio": ms["split"] / ms["one_call"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--key-heads", type=int, default=8)
    parser.add_argument("--value-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--prefill", type=int, default=300, help="tokens per prefill sequence")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the JSON list of records alone on stdout")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    records = []
    for phase, length, fresh in (("decode", 1, False), ("prefill", args.prefill, True)):
        for batch in (1, 16):
            step = step_args(args.key_heads, args.value_heads, args.head_dim, [length] * batch, fresh, torch.bfloat16)
            repeats = args.repeats if phase == "decode" else max(3, args.repeats // 5)
            records.append({"case": f"{phase} b{batch}", "tokens": length * batch, **measure(step, repeats)})
    for batch in (1, 16):
        step = step_args(args.key_heads, args.value_heads, args.head_dim, [1] * batch + [args.prefill], False,
                         torch.bfloat16)
        step["fresh"] = torch.tensor([False] * batch + [True])
        records.append({"case": f"mixed b{batch}+1", "tokens": batch + args.prefill,
                        **measure_split(step, batch, max(3, args.repeats // 5))})
    if args.json:
        print(json.dumps(records, indent=1))
        return
    for r in records:
        pair = (f"fused {r['fused_ms']:9.2f} ms  composed {r['composed_ms']:9.2f} ms" if "fused_ms" in r
                else f"split {r['split_ms']:9.2f} ms  one call {r['one_call_ms']:9.2f} ms")
        print(f"{r['case']:<12} {r['tokens']:>6} tokens  {pair}  ratio {r['ratio']:.3f}")


if __name__ == "__main__":
    main()
