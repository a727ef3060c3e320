"""Offline assets for the embedded CPU default: tiny Qwen3 models, a tokenizer, a verifiable task.

Nothing here touches a model hub. Models are transformers' own ``Qwen3ForCausalLM`` and
``Qwen3MoeForCausalLM`` with random weights from a fixed seed; the tokenizer is a character-level
``tokenizers`` model with a Qwen-style chat template; the task is string reversal with a
partial-credit reward in [0, 1], so even a random policy earns varied rewards. Everything is built
deterministically and cached: :func:`ensure_assets` is idempotent.
"""

from __future__ import annotations

import json
import os
import random
import string
from collections import Counter
from pathlib import Path

ASSETS_ENV = "TRUE_ON_POLICY_ASSETS"
MODEL_KINDS = ("dense", "moe")
MODEL_DIRS = {"dense": "qwen3_tiny", "moe": "qwen3_moe_tiny"}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Characters the task and the chat template use; one token each.
CHARACTERS = list(string.ascii_letters + string.digits + string.punctuation + " \n")
VOCAB_SIZE = 128  # >= len(SPECIAL_TOKENS) + len(CHARACTERS); a multiple of 16 for the kernels' tiles

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

DATA_SOURCE = "true_on_policy/reverse"


def default_root() -> Path:
    return Path(os.environ.get(ASSETS_ENV) or Path.home() / ".cache" / "true_on_policy")


def tiny_model_config(kind: str):
    """The transformers config of a tiny model: 2 layers, hidden 64, GQA 4/2 heads of 16."""
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
        dtype="float32",
    )
    if kind == "dense":
        from transformers import Qwen3Config

        return Qwen3Config(intermediate_size=128, **common)
    if kind == "moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            **common,
        )
    raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {MODEL_KINDS}")


def build_model(kind: str, seed: int = 0):
    """A tiny model with random weights drawn from ``seed`` (same seed, same weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_model_config(kind)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def build_tokenizer():
    """A character-level fast tokenizer with Qwen's chat markers; no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    assert len(vocab) <= VOCAB_SIZE
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def reverse_task(rng: random.Random) -> dict:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
    return {"question": f"Reverse: {word}", "answer": word[::-1]}


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """Partial credit in [0, 1] for reversing a word (verl's ``custom_reward_function`` signature).

    Half for the answer's characters present in the first ``len(answer)`` characters of the
    response (as a multiset), half for characters in the right place. Even a random policy earns
    some credit now and then, so rewards vary from the first step and there is a signal to learn.
    """
    if not ground_truth:
        return 0.0
    window = solution_str.split("<|im_end|>")[0].strip()[: len(ground_truth)]
    present = sum((Counter(window) & Counter(ground_truth)).values())
    in_place = sum(a == b for a, b in zip(window, ground_truth))
    return 0.5 * (present + in_place) / len(ground_truth)


def build_dataset(directory: Path, n_train: int = 256, n_val: int = 32, seed: int = 0) -> None:
    """Write verl-format parquet files ``train.parquet`` and ``val.parquet``."""
    import pandas as pd

    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("val", n_val)):
        rows = []
        for index in range(n):
            task = reverse_task(rng)
            rows.append(
                {
                    "data_source": DATA_SOURCE,
                    "prompt": [{"role": "user", "content": task["question"]}],
                    "ability": "string",
                    "reward_model": {"style": "rule", "ground_truth": task["answer"]},
                    "extra_info": {"split": split, "index": index},
                }
            )
        pd.DataFrame(rows).to_parquet(directory / f"{split}.parquet")


def ensure_assets(root: Path | None = None) -> Path:
    """Build every asset that is missing under ``root`` (default: :func:`default_root`)."""
    root = Path(root) if root is not None else default_root()
    stamp_name = "BUILT"
    for kind in MODEL_KINDS:
        target = root / MODEL_DIRS[kind]
        if (target / stamp_name).exists():
            continue
        target.mkdir(parents=True, exist_ok=True)
        build_model(kind).save_pretrained(target, safe_serialization=True)
        build_tokenizer().save_pretrained(target)
        (target / stamp_name).write_text(json.dumps({"kind": kind, "seed": 0}))
    data = root / "reverse"
    if not (data / stamp_name).exists():
        build_dataset(data)
        (data / stamp_name).write_text("ok")
    return root
