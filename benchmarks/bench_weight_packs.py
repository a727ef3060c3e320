"""What laying weights out once saves: vLLM's consistent linears and experts with and without packs, in one run.

vLLM's consistent model keeps each linear's weight (``ops.pack_weight``) and each expert's weights
(``ops.pack_experts``) laid out for their native calls, rebuilt after every weight load: the dot path's
packs for bf16 on AVX-512 BF16, else the chain path's; without packs every call lays each weight out again.
Per kind, dtype and token count (decode: 1 and 16 tokens, prefill: 256), ``--layers`` layers are run with
packs ("packed") and without ("unpacked"), alternating within each repeat; the layers' weights together
exceed the last-level cache as a real model's do. The bits are asserted equal first.

* ``dense``: a dense decoder layer's linears (hidden ``--hidden``, q/k/v of ``--heads`` / ``--kv-heads``
  heads of 64, o, gate and up of width 3 x hidden, down), each projection its own ``ops.linear``.
* ``moe``: ``--experts`` experts (width ``--width``, top-``--top-k``) through ``moe.moe_experts``.

    python benchmarks/bench_weight_packs.py [--json] [--repeats N] [--kind dense,moe] [--dtype float32,bfloat16]

Records: ``case`` ("moe experts bfloat16 t16", "dense linears float32 t1"), ``kind``, ``dtype``, ``tokens``,
``packed_ms`` and ``unpacked_ms`` (the median per layer over the repeats) and ``ratio`` (packed / unpacked;
< 1: packing saves time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from true_on_policy.kernels import moe, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,256", help="comma-separated token counts")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--kind", default="dense,moe", help="comma-separated: dense, moe")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--json", action="store_true", help="JSON records alone on stdout")
    args = parser.parse_args()
    records = []
    for kind in args.kind.split(","):
        if kind not in LAYERS:
            raise SystemExit(f"bench_weight_packs: --kind {kind!r} is not dense or moe")
        for name in args.dtype.split(","):
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(name)
            if dtype is None:
                raise SystemExit(f"bench_weight_packs: --dtype {name!r} is not float32 or bfloat16")
            records += measure(args, kind, dtype)
    if args.json:
        print(json.dumps(records, indent=1))
        return
    print(f"load average {os.getloadavg()[0]:.2f}; {args.layers} layers, hidden {args.hidden}; dense: {args.heads} / "
          f"{args.kv_heads} heads; moe: {args.experts} experts of width {args.width}, top-{args.top_k}; "
          f"{torch.get_num_threads()} threads")
    for r in records:
        print(f"{r['case']:>27}: packed {r['packed_ms']:8.3f} ms  unpacked {r['unpacked_ms']:8.3f} ms  ratio {r['ratio']:.3f}")


def dense_layer(args, dtype, gen):
    """A dense decoder layer's projections as ``run(x, packed)`` -> outputs, and its packs."""
    h, q, kv = args.hidden, args.heads * 64, args.kv_heads * 64
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (3 * h, h), (3 * h, h), (h, 3 * h)]  # q k v o gate up down
    weights = [(torch.randn(s, generator=gen) * 0.05).to(dtype) for s in shapes]
    packs = [ops.pack_weight(w) for w in weights]
    inputs = {}  # (rows, K) -> the input of a projection reducing K (o: the attention's, down: the activation)

    def run(x, packed):
        out = []
        for w, p in zip(weights, packs):
            if (x.shape[0], w.shape[1]) not in inputs:
                inputs[x.shape[0], w.shape[1]] = torch.randn(x.shape[0], w.shape[1], generator=gen).to(dtype)
            out.append(ops.linear(x if w.shape[1] == h else inputs[x.shape[0], w.shape[1]], w,
                                  pack=p if packed else None))
        return out

    return run, packs


def moe_layer(args, dtype, gen):
    """An MoE layer's experts as ``run(x, packed)`` -> outputs (top-k experts chosen per call), and its packs."""
    shape = (args.experts, 2 * args.width, args.hidden), (args.experts, args.hidden, args.width)
    gate_up, down = ((torch.randn(s, generator=gen) * 0.05).to(dtype) for s in shape)
    pack = ops.pack_experts(gate_up, down)
    chosen = {}

    def run(x, packed):
        if x.shape[0] not in chosen:  # one routing per token count, the same for both variants
            chosen[x.shape[0]] = torch.stack([torch.randperm(args.experts, generator=gen)[: args.top_k] for _ in x])
        return [moe.moe_experts(x, chosen[x.shape[0]], gate_up, down, packs=pack if packed else None)]

    return run, [pack]


LAYERS = {"dense": ("linears", dense_layer), "moe": ("experts", moe_layer)}


def measure(args, kind: str, dtype: torch.dtype) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    what, build = LAYERS[kind]
    layers = [build(args, dtype, gen) for _ in range(args.layers)]
    if any(p is None for _, packs in layers for p in packs):
        raise SystemExit(f"bench_weight_packs: no {dtype} {kind} pack on this machine (the native library's checks failed)")
    records = []
    name = str(dtype).removeprefix("torch.")
    for tokens in (int(t) for t in args.tokens.split(",")):
        hidden = torch.randn(tokens, args.hidden, generator=gen).to(dtype)

        def run(packed: bool) -> list[torch.Tensor]:
            return [out for layer, _ in layers for out in layer(hidden, packed)]

        if not all(torch.equal(a, b) for a, b in zip(run(True), run(False))):
            raise SystemExit(f"bench_weight_packs: packed and unpacked {dtype} {kind} layers differ at {tokens} tokens")
        times: dict[str, list[float]] = {"packed": [], "unpacked": []}
        for _ in range(args.repeats):
            for variant in times:
                start = time.perf_counter()
                run(variant == "packed")
                times[variant].append((time.perf_counter() - start) / args.layers * 1e3)
        packed_ms, unpacked_ms = statistics.median(times["packed"]), statistics.median(times["unpacked"])
        records.append({"case": f"{kind} {what} {name} t{tokens}", "kind": kind, "dtype": name, "tokens": tokens,
                        "packed_ms": round(packed_ms, 3), "unpacked_ms": round(unpacked_ms, 3),
                        "ratio": round(packed_ms / unpacked_ms, 3)})
    return records


if __name__ == "__main__":
    main()
