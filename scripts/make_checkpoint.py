"""Write a random Qwen3 / Qwen3-MoE / Qwen3.5 / Qwen3.5-MoE checkpoint of chosen size, with the tiny tokenizer.

For timing runs on compute-dominated models (``benchmarks/bench_vllm_kernels.py --model DIR``): the
shipped tiny model's config (``true_on_policy.tiny_assets.tiny_model_config``: vocabulary, special ids,
RoPE, 1024 positions) with the sizes given here, weights drawn from ``--seed`` and stored in bf16 next
to the tiny tokenizer (``tiny_assets.save_checkpoint``). The directory is overwritten.

    python scripts/make_checkpoint.py DIR --kind dense --hidden 1024 --layers 6 --heads 16 --kv-heads 8 --head-dim 64
    python scripts/make_checkpoint.py DIR --kind moe ... --experts 16 --top-k 4 --expert-width 512
    python scripts/make_checkpoint.py DIR --kind qwen35 --layers 4 --heads 8 --kv-heads 2 --head-dim 256

``qwen35`` / ``qwen35_moe``: Qwen3.5's text model, layers in its 3:1 order (three Gated DeltaNet, then one
gated full attention), GDN heads from ``--gdn-key-heads`` / ``--gdn-value-heads`` of ``--gdn-head-dim``
(defaults: Qwen3.5's 8 / 16 of 128); the MoE adds a shared expert of ``--expert-width``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from true_on_policy import tiny_assets


def config(args):
    """The tiny model's config of ``args.kind`` with the sizes of ``args``."""
    tiny = tiny_assets.tiny_model_config(args.kind)
    values = tiny.to_dict()
    values.pop("layer_types", None)  # derived from the layer count: rebuilt for the new one
    if args.kind.startswith("qwen35"):
        values.update(linear_num_key_heads=args.gdn_key_heads, linear_num_value_heads=args.gdn_value_heads,
                      linear_key_head_dim=args.gdn_head_dim, linear_value_head_dim=args.gdn_head_dim)
    values.update(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate or 3 * args.hidden,
    )
    cfg = type(tiny).from_dict(values)
    if args.kind in ("moe", "qwen35_moe"):  # attribute names: transformers maps num_experts to the key it stores
        cfg.num_experts = args.experts
        cfg.num_experts_per_tok = args.top_k
        cfg.moe_intermediate_size = args.expert_width
    if args.kind == "qwen35_moe":
        cfg.shared_expert_intermediate_size = args.expert_width
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--kind", choices=("dense", "moe", "qwen35", "qwen35_moe"), default="dense")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=None, help="dense MLP width (default 3 x hidden)")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--gdn-key-heads", type=int, default=8, help="qwen35*: Gated DeltaNet key heads")
    parser.add_argument("--gdn-value-heads", type=int, default=16, help="qwen35*: Gated DeltaNet value heads")
    parser.add_argument("--gdn-head-dim", type=int, default=128, help="qwen35*: Gated DeltaNet head dim")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.kind.endswith("moe") and not 1 <= args.top_k <= args.experts:
        parser.error(f"--top-k {args.top_k}: need 1 <= top-k <= --experts {args.experts}")

    from true_on_policy.kernels import architectures

    cfg = config(args)
    architectures.check_config(cfg.to_dict())  # an uncovered shape fails here, naming it, not in an engine
    args.directory.mkdir(parents=True, exist_ok=True)
    path = tiny_assets.save_checkpoint(cfg, args.directory, seed=args.seed)
    params = sum(math.prod(shape) for shape in _shapes(path))
    print(f"{path}: {args.kind}, {params / 1e6:.1f} M parameters")


def _shapes(path: str):
    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                yield handle.get_slice(key).get_shape()


if __name__ == "__main__":
    main()
