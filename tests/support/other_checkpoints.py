"""Checkpoints of other shapes than the shipped tiny models, for "any checkpoint" checks.

Each uses the tiny tokenizer (saved next to the weights, as verl and vLLM read it from the model
path; the byte-level form for Qwen2, which transformers loads as Qwen2Tokenizer) and bf16 weights on
disk. The Qwen3 ones have head counts divisible by 2 (for TP 2); the MoE one routes top-3 of 8
experts and has a dense layer (``mlp_only_layers``).
"""

from __future__ import annotations

from true_on_policy import tiny_assets

COMMON = dict(
    vocab_size=160, hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
    intermediate_size=160, max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=False,
    eos_token_id=tiny_assets.SPECIAL_TOKENS.index("<|im_end|>"), pad_token_id=0, bos_token_id=None,
)


def moe_checkpoint(directory) -> str:
    """head_dim 32, GQA 6/2, 3 layers with a dense one, 8 experts top-3, vocabulary 160."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        moe_intermediate_size=48, num_experts=8, num_experts_per_tok=3, mlp_only_layers=[1], norm_topk_prob=False,
        **COMMON,
    )
    return tiny_assets.save_checkpoint(config, directory)


def qwen2_checkpoint(directory) -> str:
    """R1-Distill-Qwen-like (untied head): hidden 128, GQA 8/2, 3 layers, vocabulary 160, rope_theta
    1e6, the sliding-window keys of a real Qwen2.5 config.json (use_sliding_window false)."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=160, hidden_size=128, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=192, max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=False,
        use_sliding_window=False, sliding_window=4096, max_window_layers=21, eos_token_id=2, pad_token_id=0,
    )
    return tiny_assets.save_checkpoint(config, directory, 12)


def llama_checkpoint(directory) -> str:
    """Attention and MLP biases, tied head, 6 query heads over 3 kv heads of 16, Llama-3 RoPE scaling
    with other factors than the shipped tiny Llama's."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=160, hidden_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
        head_dim=16, intermediate_size=128, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
        max_position_embeddings=512, eos_token_id=2, pad_token_id=0, bos_token_id=None,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )
    return tiny_assets.save_checkpoint(config, directory, 13)


def qwen35_moe_checkpoint(directory) -> str:
    """A Qwen3.5-MoE text model of another shape than the shipped one: hidden 96, 3 layers (Gated DeltaNet,
    gated attention, Gated DeltaNet), GDN 2 key heads of 32 / 6 value heads of 32, attention GQA 6/2 of
    head_dim 32 with partial RoPE 0.5, 8 experts top-3 and a shared expert of 48, vocabulary 160."""
    from transformers import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        vocab_size=160, hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        head_dim=32, layer_types=["linear_attention", "full_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        partial_rotary_factor=0.5,  # the config class writes a top-level 0.25 otherwise, which vLLM would read
        linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=6, moe_intermediate_size=48, shared_expert_intermediate_size=48, num_experts=8,
        num_experts_per_tok=3, max_position_embeddings=512, tie_word_embeddings=False,
        architectures=["Qwen3_5MoeForCausalLM"],
        eos_token_id=tiny_assets.SPECIAL_TOKENS.index("<|im_end|>"), pad_token_id=0, bos_token_id=None,
    )
    return tiny_assets.save_checkpoint(config, directory, 14)


def qwen35_mrope_checkpoint(directory) -> str:
    """A dense Qwen3.5 text model carrying a real checkpoint's multimodal RoPE keys (``rope_parameters``
    ``mrope_section`` [3, 3, 2] over the 8 frequencies of partial RoPE 0.5 on head_dim 32, ``mrope_interleaved``
    true), which vLLM 0.28 - 0.31 drop for the text model (1-D positions). Hidden 96, 3 layers (Gated DeltaNet,
    gated attention, Gated DeltaNet), GDN 2 key heads / 4 value heads of 16, GQA 6/2, vocabulary 160."""
    from transformers import Qwen3_5TextConfig

    rope = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5, "mrope_section": [3, 3, 2],
            "mrope_interleaved": True}
    config = Qwen3_5TextConfig(
        vocab_size=160, hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        head_dim=32, layer_types=["linear_attention", "full_attention", "linear_attention"], rope_parameters=rope,
        partial_rotary_factor=0.5,  # the config class writes a top-level 0.25 otherwise, which vLLM would read
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, intermediate_size=160, max_position_embeddings=512, tie_word_embeddings=False,
        architectures=["Qwen3_5ForCausalLM"],
        eos_token_id=tiny_assets.SPECIAL_TOKENS.index("<|im_end|>"), pad_token_id=0, bos_token_id=None,
    )
    return tiny_assets.save_checkpoint(config, directory, 15)


def dense_mrope_checkpoint(directory) -> str:
    """A dense Qwen3 (head_dim 32, GQA 6/2, 3 layers, intermediate 160, vocabulary 160) whose ``rope_parameters``
    carry a multimodal checkpoint's ``mrope_section`` (its 16 frequencies as [6, 5, 5]): vLLM builds
    ``MRotaryEmbedding`` for it, which Qwen3 cannot feed."""
    from transformers import Qwen3Config

    rope = {"rope_type": "default", "rope_theta": COMMON["rope_theta"], "mrope_section": [6, 5, 5]}
    return tiny_assets.save_checkpoint(Qwen3Config(**{**COMMON, "rope_theta": None}, rope_parameters=rope), directory)
