"""``python -m true_on_policy diagnose``: the first op where training and rollout diverge.

Loads a model twice (the training copy and the rollout copy) -- the tiny offline assets by default,
``--checkpoint DIR`` for any local Hugging Face checkpoint of a Qwen3 / Qwen3-MoE (or same-structure)
model, ``--rollout-checkpoint DIR`` to load the rollout copy from other files (e.g. the weights as the
rollout engine received them) -- optionally plants a known fault in the rollout copy (``--inject``),
scores ``--prompts`` random sequences on both paths (training: one padded batch; rollout: prefill +
teacher-forced decode over KV caches) and prints the per-layer, per-op |Δ| table and the first
divergence. ``--json FILE`` writes the report, ``--plot FILE`` a PNG heatmap of max |Δ| by layer and op.

Exit status: 0 whatever the diagnosis (a divergence is a finding, not an error); 2 for bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys

class _BadInput(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    from true_on_policy import tiny_assets
    from true_on_policy.kernels.scope import KERNEL_DTYPES
    from true_on_policy.diagnose import FAULTS

    p = argparse.ArgumentParser(
        prog="python -m true_on_policy diagnose",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="faults (planted in the rollout copy):\n"
        + "\n".join(f"  {name:16s} {text}" for name, text in FAULTS.items()),
    )
    src = p.add_argument_group("models")
    src.add_argument(
        "--model", choices=tiny_assets.MODEL_KINDS, default=None, help="tiny offline model (default: dense)"
    )
    src.add_argument("--checkpoint", default=None, help="a local Hugging Face checkpoint directory (both copies)")
    src.add_argument("--rollout-checkpoint", default=None, help="load the rollout copy from this directory instead")
    src.add_argument("--dtype", choices=KERNEL_DTYPES, default="float32")
    src.add_argument(
        "--no-deterministic", action="store_true", help="default kernels on both sides (consistent kernels off)"
    )
    run = p.add_argument_group("run")
    run.add_argument("--inject", choices=sorted(FAULTS), default=None, help="plant a fault in the rollout copy")
    run.add_argument("--layer", type=int, default=-1, help="layer the fault goes to (default: the last)")
    run.add_argument("--prompts", type=int, default=3, help="number of sequences (default 3)")
    run.add_argument("--prompt-len", type=int, default=12, help="longest prompt; prompts spread up to it (default 12)")
    run.add_argument("--new-tokens", type=int, default=6, help="teacher-forced decode tokens per sequence (default 6)")
    run.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    out = p.add_argument_group("output")
    out.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    out.add_argument("--plot", default=None, metavar="FILE", help="write a PNG of max |Δ| by layer and op")
    out.add_argument("--only-diff", action="store_true", help="print only the rows that differ")
    return p


def _prompt_lengths(count: int, longest: int) -> list[int]:
    shortest = max(1, longest // 3)
    if count == 1:
        return [longest]
    return [shortest + round(i * (longest - shortest) / (count - 1)) for i in range(count)]


def _check_dir(path: str, flag: str) -> None:
    if not os.path.isdir(path):
        raise _BadInput(f"{flag} {path!r}: not a directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise _BadInput(f"{flag} {path!r}: no config.json (not a Hugging Face checkpoint directory)")


def _load(path: str, dtype, flag: str):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except Exception as exc:  # a checkpoint transformers cannot load is bad input
        raise _BadInput(f"{flag} {path!r}: cannot load it with transformers: {type(exc).__name__}: {exc}") from exc
    return model.eval()


def _check_args(args) -> None:
    """Refuse bad flags before anything is loaded."""
    from true_on_policy.diagnose import NEEDS_CONSISTENT_KERNELS

    if args.model is not None and args.checkpoint is not None:
        raise _BadInput("give either --model or --checkpoint, not both")
    if args.prompts < 1 or args.prompt_len < 1 or args.new_tokens < 0:
        raise _BadInput("--prompts and --prompt-len must be >= 1, --new-tokens >= 0")
    if args.inject in NEEDS_CONSISTENT_KERNELS and args.no_deterministic:
        raise _BadInput(
            f"--inject {args.inject} acts on the consistent kernels; it cannot be combined with --no-deterministic"
        )
    if args.checkpoint is not None:
        _check_dir(args.checkpoint, "--checkpoint")
    if args.rollout_checkpoint is not None:
        _check_dir(args.rollout_checkpoint, "--rollout-checkpoint")


def _load_models(args):
    """``(training, rollout, source, label)``: the two copies, the directory they came from and its
    name in the report."""
    from true_on_policy import tiny_assets
    from true_on_policy.transformers_adapter.forwards import patch_transformers
    from true_on_policy.kernels.ops import DTYPES

    dtype = DTYPES[args.dtype]
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    patch_transformers()  # before building: linears become ConsistentLinear at init
    if args.checkpoint is None:
        kind = args.model or "dense"
        source = str(tiny_assets.ensure_assets() / tiny_assets.MODEL_DIRS[kind])
        label = f"tiny {kind}"
    else:
        source = args.checkpoint
        label = os.path.basename(os.path.normpath(source))
    training = _load(source, dtype, "--checkpoint")
    if args.rollout_checkpoint is not None:
        rollout = _load(args.rollout_checkpoint, dtype, "--rollout-checkpoint")
    else:
        rollout = copy.deepcopy(training)
    return training, rollout, source, label


def _check_fits(args, config) -> None:
    """The fault's layer and the longest sequence fit the model."""
    n_layers = config.num_hidden_layers
    if not -n_layers <= args.layer < n_layers:
        raise _BadInput(f"--layer {args.layer}: the model has {n_layers} layers")
    longest = args.prompt_len + args.new_tokens
    if longest > config.max_position_embeddings:
        raise _BadInput(
            f"--prompt-len + --new-tokens = {longest} exceeds max_position_embeddings {config.max_position_embeddings}"
        )


def _plant_fault(args, training, rollout) -> str | None:
    """Plant ``--inject`` in the rollout copy; its description (None without --inject)."""
    from true_on_policy.diagnose import inject_fault, make_router_ties

    if args.inject is None:
        return None
    try:
        if args.inject == "router-tiebreak":
            for model in (training, rollout):  # ties must exist for a tie-break to matter
                make_router_ties(model, args.layer)
        fault = inject_fault(rollout, args.inject, args.layer)
    except (ValueError, AttributeError) as exc:
        raise _BadInput(f"--inject {args.inject}: {exc}") from exc
    if args.inject == "router-tiebreak":
        fault += " (router rows of experts 0 and 1 zeroed on both copies, so ties occur)"
    return fault


def run(args) -> int:
    import torch

    from true_on_policy.diagnose import diagnose
    from true_on_policy.kernels.architectures import UnsupportedFeatureError

    _check_args(args)
    training, rollout, source, label = _load_models(args)
    config = training.config
    _check_fits(args, config)
    fault = _plant_fault(args, training, rollout)

    generator = torch.Generator().manual_seed(args.seed)
    low = 3 if config.vocab_size > 3 else 0
    prompts = _prompt_lengths(args.prompts, args.prompt_len)
    sequences = [
        torch.randint(low, config.vocab_size, (p + args.new_tokens,), generator=generator).tolist() for p in prompts
    ]
    try:
        report = diagnose(training, rollout, sequences, prompt_lengths=prompts, deterministic=not args.no_deterministic)
    except UnsupportedFeatureError as exc:  # a model the consistent kernels do not cover
        raise _BadInput(f"this model is not covered by the consistent kernels: {exc}") from exc
    report.settings.update(model=label, checkpoint=source, fault=fault, rollout_checkpoint=args.rollout_checkpoint)
    print(report.format(only_differing=args.only_diff))
    if args.json:
        report.to_json(args.json)
        print(f"\nwrote {args.json}")
    if args.plot:
        report.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        return run(args)
    except _BadInput as exc:
        print(f"python -m true_on_policy diagnose: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
