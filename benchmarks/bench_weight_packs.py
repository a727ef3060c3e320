"""What packing the experts' weights once saves: ``ops.moe_experts`` with and without packs, in one run.

vLLM's consistent MoE block keeps each expert's weights laid out for its native call
(``ops.pack_experts``, rebuilt after every weight load: the dot path's packs for bf16 on AVX-512 BF16,
else the chain path's); without packs every call lays each expert's weight out again. Per dtype and token
count (decode: 1 and 16 tokens, prefill: 256), ``--layers`` MoE layers of ``--experts`` experts (hidden
``--hidden``, width ``--width``, top-``--top-k``) are run with packs ("packed") and without ("unpacked"),
alternating within each repeat; the layers' weights together exceed the last-level cache as a real
model's do. The bits are asserted equal first.

    python benchmarks/bench_weight_packs.py [--json] [--repeats N] [--dtype float32,bfloat16]

Records: ``case`` ("moe experts bfloat16 t16"), ``dtype``, ``tokens``, ``packed_ms`` and ``unpacked_ms``
(the median per layer over the repeats) and ``ratio`` (packed / unpacked; < 1: packing saves time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from true_on_policy.kernels import ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,256", help="comma-separated token counts")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--json", action="store_true", help="JSON records alone on stdout")
    args = parser.parse_args()
    records = []
    for name in args.dtype.split(","):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(name)
        if dtype is None:
            raise SystemExit(f"bench_weight_packs: --dtype {name!r} is not float32 or bfloat16")
        records += measure(args, dtype)
    if args.json:
        print(json.dumps(records, indent=1))
        return
    print(f"load average {os.getloadavg()[0]:.2f}; {args.layers} layers x {args.experts} experts, hidden {args.hidden}, "
          f"width {args.width}, top-{args.top_k}, {torch.get_num_threads()} threads")
    for r in records:
        print(f"{r['case']:>27}: packed {r['packed_ms']:8.3f} ms  unpacked {r['unpacked_ms']:8.3f} ms  ratio {r['ratio']:.3f}")


def measure(args, dtype: torch.dtype) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    shape = (args.experts, 2 * args.width, args.hidden), (args.experts, args.hidden, args.width)
    layers = [tuple((torch.randn(s, generator=gen) * 0.05).to(dtype) for s in shape) for _ in range(args.layers)]
    packs = [ops.pack_experts(gate_up, down) for gate_up, down in layers]
    if any(p is None for p in packs):
        raise SystemExit(f"bench_weight_packs: no {dtype} pack on this machine (the native library's checks failed)")
    records = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        hidden = torch.randn(tokens, args.hidden, generator=gen).to(dtype)
        chosen = torch.stack([torch.randperm(args.experts, generator=gen)[: args.top_k] for _ in range(tokens)])

        def run(packed: bool) -> list[torch.Tensor]:
            return [ops.moe_experts(hidden, chosen, gate_up, down, packs=pack if packed else None)
                    for (gate_up, down), pack in zip(layers, packs)]

        if not all(torch.equal(a, b) for a, b in zip(run(True), run(False))):
            raise SystemExit(f"bench_weight_packs: packed and unpacked {dtype} experts differ at {tokens} tokens")
        times: dict[str, list[float]] = {"packed": [], "unpacked": []}
        for _ in range(args.repeats):
            for name in times:
                start = time.perf_counter()
                run(name == "packed")
                times[name].append((time.perf_counter() - start) / args.layers * 1e3)
        packed_ms, unpacked_ms = statistics.median(times["packed"]), statistics.median(times["unpacked"])
        records.append({"case": f"moe experts {str(dtype).removeprefix('torch.')} t{tokens}",
                        "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "packed_ms": round(packed_ms, 3),
                        "unpacked_ms": round(unpacked_ms, 3), "ratio": round(packed_ms / unpacked_ms, 3)})
    return records


if __name__ == "__main__":
    main()
