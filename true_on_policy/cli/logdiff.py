"""``python -m true_on_policy logdiff``: training-vs-rollout log-prob differences per token.

For each model, dtype and flag value, a rollout engine (the CPU engine, or vLLM-CPU with
``--engine vllm``, at one or more ``--tp`` / ``--ep``) samples tokens and records their log-probs;
the training path rescores them packed in micro-batches of another composition; each record gives
max/mean |Δ| and the fraction of bitwise-equal tokens. With the flag on every ``max_abs_diff`` is
exactly 0.0 (``torch.equal``); flag off is the twin that shows the check is not vacuous.
An uncovered model or a TP / EP the kernels do not keep bitwise is refused before any engine
starts. Details: docs/true_on_policy.md ("logdiff").
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from true_on_policy import tiny_assets
from true_on_policy.cli.json_output import stdout_to_stderr
from true_on_policy.config.platforms import is_cpu_engine, is_vllm
from true_on_policy.rollout.packed_forward import forward_packed
from true_on_policy.transformers_adapter.forwards import patch_transformers
from true_on_policy.kernels import ops
from true_on_policy.rollout.engine import RolloutEngine, SamplingParams


def prompt_lengths(count: int, longest: int = 200) -> list[int]:
    """``count`` lengths from 1 to ``longest``, spread evenly (both ends included)."""
    if count == 1:
        return [longest]
    return [1 + round(i * (longest - 1) / (count - 1)) for i in range(count)]


def make_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    low = len(tiny_assets.SPECIAL_TOKENS)
    return [torch.randint(low, vocab_size, (n,), generator=generator).tolist() for n in prompt_lengths(count)]


def rollout(model, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """(generated tokens, recorded log-probs) per prompt, from one continuous-batching run."""
    engine = RolloutEngine(model, eos_token_id=None, max_num_seqs=len(prompts), max_model_len=4096)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, SamplingParams(max_new_tokens=new_tokens, seed=index))
    done = engine.run_until_done()
    return [(done[str(i)].token_ids, torch.tensor(done[str(i)].log_probs)) for i in range(len(prompts))]


@torch.no_grad()
def score(model, sequences: list[list[int]], prompt_lens: list[int], micro_batch: int) -> list[torch.Tensor]:
    """Log-probs of each sequence's generated tokens, scored packed, in reversed micro-batches."""
    order = list(reversed(range(len(sequences))))
    scores: dict[int, torch.Tensor] = {}
    for start in range(0, len(order), micro_batch):
        group = order[start : start + micro_batch]
        ids = torch.tensor([token for i in group for token in sequences[i]])
        positions = torch.cat([torch.arange(len(sequences[i])) for i in group])
        logits = forward_packed(model, ids, positions, [len(sequences[i]) for i in group], None)
        offset = 0
        for i in group:
            n, p = len(sequences[i]), prompt_lens[i]
            rows = logits[offset + p - 1 : offset + n - 1]
            labels = torch.tensor(sequences[i][p:])
            scores[i] = ops.token_log_probs(rows, labels)
            offset += n
    return [scores[i] for i in range(len(sequences))]


def measure(kind: str, dtype: str, deterministic: bool, prompts: int, new_tokens: int, micro_batch: int) -> dict:
    with ops.consistent(deterministic):
        model = tiny_assets.build_model(kind).to(ops.DTYPES[dtype])
        prompt_ids = make_prompts(prompts, model.config.vocab_size)
        outputs = rollout(model, prompt_ids, new_tokens)
        sequences = [p + out for p, (out, _) in zip(prompt_ids, outputs)]
        trained = score(model, sequences, [len(p) for p in prompt_ids], micro_batch)
    recorded = torch.cat([log_probs for _, log_probs in outputs])
    scored = torch.cat(trained).to(recorded.dtype)
    diff = (recorded - scored).abs()
    return {
        "model": kind,
        "dtype": dtype,
        "deterministic": deterministic,
        "max_abs_diff": 0.0 if torch.equal(recorded, scored) else float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "frac_equal": float((recorded == scored).float().mean()),
        "tokens": int(recorded.numel()),
    }


STOCK_EP_CRASH = (
    "vLLM-CPU's stock fused-MoE kernel crashes with expert parallelism (a segfault in cpu_fused_moe.cpp; seen on "
    "0.28.0 and 0.31.0); the flag-off engine cannot run with --ep"
)
STOCK_GDN_FP32 = (
    "vLLM-CPU's stock Gated DeltaNet asserts bf16 ('CPU GDN attention requires BF16'; seen on 0.28.0 and 0.31.0); "
    "the flag-off engine cannot run a hybrid model in float32"
)


def measure_vllm(kind: str, path: str, dtype: str, deterministic: bool, prompts: int, new_tokens: int,
                 micro_batch: int, temperature: float, tp: int = 1, ep: bool = False,
                 greedy: bool = False) -> tuple[dict, list | None]:
    """(record, greedy samples or None) of one vLLM engine at ``tp`` (and EP over its ranks iff ``ep``)."""
    from true_on_policy.kernels import architectures
    from true_on_policy.vllm_adapter import engine

    ep_size = tp if ep else 1
    record = {"engine": "vllm", "model": kind, "dtype": dtype, "deterministic": deterministic, "tp": tp,
              "ep": ep_size, "temperature": temperature}
    if ep_size > 1 and not deterministic:
        return {**record, "skipped": STOCK_EP_CRASH}, None
    if not deterministic and dtype == "float32" and "linear_attention" in (
            (architectures.read_checkpoint(path) or {}).get("layer_types") or ()):
        return {**record, "skipped": STOCK_GDN_FP32}, None
    llm = engine.start(path, dtype, deterministic, tp=tp, ep=ep_size > 1)
    try:
        model = engine.load_training_model(path, dtype)
        prompt_ids = make_prompts(prompts, model.config.vocab_size)
        samples = engine.generate(llm, prompt_ids, new_tokens, n=2, temperature=temperature)
        greedy_samples = engine.generate(llm, prompt_ids, new_tokens, n=1, temperature=0.0) if greedy else None
    finally:
        llm.llm_engine.engine_core.shutdown()
    recorded = engine.recorded(samples)
    scored = engine.score(model, prompt_ids, samples, deterministic, None, temperature, micro_batch)
    diff = (recorded - scored).abs()
    return {
        **record,
        "max_abs_diff": 0.0 if torch.equal(recorded, scored) else float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "frac_equal": float((recorded == scored).float().mean()),
        "tokens": int(recorded.numel()),
    }, greedy_samples


def compare_to_baseline(record: dict, samples, baseline_tp: int, baseline_samples) -> dict:
    """The recorded log-probs of greedy ``samples`` against the baseline TP's, on the samples whose tokens agree."""
    pairs = [(lp, base_lp) for per_prompt, base_prompt in zip(samples, baseline_samples)
             for (ids, lp), (base_ids, base_lp) in zip(per_prompt, base_prompt) if ids == base_ids]
    total = sum(len(per_prompt) for per_prompt in samples)
    diff = max(((a - b).abs().max().item() for a, b in pairs), default=None)
    equal = all(torch.equal(a, b) for a, b in pairs)
    return {**record, "baseline_tp": baseline_tp, "greedy_samples_with_baseline_tokens": len(pairs) / total,
            "greedy_max_abs_diff_to_baseline": 0.0 if pairs and equal else diff}


def resolve_model(model: str) -> tuple[str, str, dict]:
    """(kind label, checkpoint directory, its parsed config.json -- read once, for the architecture and
    the sharding checks) for a tiny model's name or a path; an uncovered architecture or feature exits
    2, naming it, before any engine starts."""
    import os

    from true_on_policy.kernels import architectures

    if model in tiny_assets.MODEL_KINDS:
        path = str(tiny_assets.ensure_assets() / tiny_assets.MODEL_DIRS[model])
        return model, path, architectures.read_checkpoint(path)
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise SystemExit(
            f"logdiff: --model {model!r} is neither one of {tiny_assets.MODEL_KINDS} nor a checkpoint directory "
            "with config.json"
        )
    checkpoint = architectures.read_checkpoint(model)
    try:
        architectures.check_config(checkpoint)
    except architectures.UncoveredModelError as error:
        sys.stderr.write(f"logdiff: --model {model}: {error}\n")
        raise SystemExit(2) from error
    return model, model, checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m true_on_policy logdiff", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the JSON list of records alone on stdout (logs: stderr)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=list(tiny_assets.MODEL_KINDS), choices=tiny_assets.MODEL_KINDS)
    parser.add_argument("--engine", choices=("cpu", "vllm"), default="cpu", help="the rollout engine")
    parser.add_argument("--model", action="append", help=f"one of {', '.join(tiny_assets.MODEL_KINDS)} or a local "
                        "checkpoint dir of a covered architecture (repeatable; overrides --models)")
    parser.add_argument("--dtype", action="append", choices=tuple(ops.DTYPES), help="repeatable; default: both")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (--engine vllm)")
    parser.add_argument("--tp", type=int, action="append", help="vLLM tensor-parallel size (repeatable; default 1)")
    parser.add_argument("--ep", action="store_true", help="vLLM expert parallelism over the TP ranks (TP > 1)")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.new_tokens < 1 or args.micro_batch < 1:
        parser.error("--prompts, --new-tokens and --micro-batch must be >= 1")
    if not is_vllm(args.engine) and (args.tp or args.ep):
        parser.error("--tp and --ep are for --engine vllm")
    dtypes = args.dtype or list(ops.DTYPES)
    kinds = args.model or args.models
    if is_cpu_engine(args.engine):
        unknown = [k for k in kinds if k not in tiny_assets.MODEL_KINDS]
        if unknown:
            parser.error(f"--engine cpu serves the tiny models only, got --model {unknown}")
    # --json: vLLM's logger and its engine-core process write to stdout; only the JSON goes there.
    with stdout_to_stderr(args.json):
        patch_transformers()
        if is_vllm(args.engine):
            targets = [resolve_model(m) for m in kinds]
            tps = args.tp or [1]
            _check_sharding(parser, targets, tps, args.ep)
            records = []
            for kind, path, _ in targets:
                for dtype in dtypes:
                    for flag in (True, False):
                        baseline = None
                        for tp in tps:
                            ep = args.ep and tp > 1
                            record, samples = measure_vllm(kind, path, dtype, flag, args.prompts, args.new_tokens,
                                                           args.micro_batch, args.temperature, tp, ep, len(tps) > 1)
                            if baseline is not None and samples is not None:
                                record = compare_to_baseline(record, samples, *baseline)
                            elif samples is not None:
                                baseline = (tp, samples)
                            records.append(record)
        else:
            records = [
                measure(kind, dtype, flag, args.prompts, args.new_tokens, args.micro_batch)
                for kind in kinds
                for dtype in dtypes
                for flag in (True, False)
            ]
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        for r in records:
            where = f" tp={r['tp']} ep={r['ep']}" if "tp" in r else ""
            if "skipped" in r:
                print(f"{r['model']:6s} {r['dtype']:9s} deterministic={str(r['deterministic']):5s}{where} skipped: "
                      f"{r['skipped']}")
                continue
            print(
                f"{r['model']:6s} {r['dtype']:9s} deterministic={str(r['deterministic']):5s}{where} "
                f"max|Δ|={r['max_abs_diff']:.3e} mean|Δ|={r['mean_abs_diff']:.3e} "
                f"equal={r['frac_equal']:.4f} tokens={r['tokens']}"
                + (f" greedy vs tp={r['baseline_tp']}: max|Δ|={r['greedy_max_abs_diff_to_baseline']}"
                   if "baseline_tp" in r else "")
            )
    return 0


def _check_sharding(parser, targets, tps, ep: bool) -> None:
    """Every (model, TP, EP) the kernels keep bitwise, or a usage error naming it, before any engine starts."""
    from true_on_policy.kernels.architectures import check_sharding

    for kind, _, checkpoint in targets:
        for tp in tps:
            try:
                check_sharding(checkpoint, tp, tp if ep and tp > 1 else 1)
            except ValueError as error:
                parser.error(f"--model {kind} --tp {tp}{' --ep' if ep else ''}: {error}")


if __name__ == "__main__":
    sys.exit(main())
