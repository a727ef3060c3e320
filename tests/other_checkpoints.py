"""Qwen3 / Qwen3-MoE checkpoints of other shapes than the shipped tiny models, for "any checkpoint" checks.

Both use the tiny tokenizer (saved next to the weights, as verl and vLLM read it from the model
path), head counts divisible by 2 and bf16 weights on disk; the MoE one routes top-3 of 8 experts and
has a dense layer (``mlp_only_layers``).
"""

from __future__ import annotations

import torch

from true_on_policy import tiny_assets

COMMON = dict(
    vocab_size=160, hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
    intermediate_size=160, max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=False,
    eos_token_id=tiny_assets.SPECIAL_TOKENS.index("<|im_end|>"), pad_token_id=0, bos_token_id=None,
)


def _save(config, directory) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    tiny_assets.build_tokenizer().save_pretrained(directory)
    return str(directory)


def moe_checkpoint(directory) -> str:
    """head_dim 32, GQA 6/2, 3 layers with a dense one, 8 experts top-3, vocabulary 160."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        moe_intermediate_size=48, num_experts=8, num_experts_per_tok=3, mlp_only_layers=[1], norm_topk_prob=False,
        **COMMON,
    )
    return _save(config, directory)


def dense_checkpoint(directory) -> str:
    """head_dim 32, GQA 6/2, 3 layers, intermediate 160, vocabulary 160."""
    from transformers import Qwen3Config

    return _save(Qwen3Config(**COMMON), directory)
