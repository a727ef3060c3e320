"""Offline assets for the embedded CPU default: tiny models, a tokenizer, a verifiable task.

Nothing here touches a model hub. Models are transformers' own ``Qwen3ForCausalLM``,
``Qwen3MoeForCausalLM``, ``Qwen2ForCausalLM`` (QKV bias, tied embeddings) and
``LlamaForCausalLM`` (Llama-3 RoPE scaling, GQA 4:1, untied), and the hybrid ``Qwen3_5ForCausalLM`` /
``Qwen3_5MoeForCausalLM`` (Gated DeltaNet + gated attention) with random weights from a fixed seed; the tokenizer is a character-level
``tokenizers`` model with a Qwen-style chat template; the task is string reversal with a verifiable
reward in [0, 1] (:func:`compute_score`). Everything is built deterministically and cached:
:func:`ensure_assets` is idempotent.

The demo's policy (``qwen3_tiny_reverse``, :func:`build_warm_start`) is the dense model after a short
supervised warm-start on the task, run until its token loss is below :data:`WARM_START_TARGET_LOSS`,
with its output logits then divided by :data:`WARM_START_HEAT`: it knows the format and the answer's
characters but samples as if at temperature 4, so at the rollout's temperature 1 it misspells, and
often fails to stop. RL with the verifiable reward has to sharpen it and teach it to stop where the
answer ends; a random-init model cannot learn reversal from 10 RL steps of a few dozen samples on 2
cores, and a fully trained one has nothing left to learn.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import string
from pathlib import Path

ASSETS_ENV = "TRUE_ON_POLICY_ASSETS"
MODEL_KINDS = ("dense", "moe", "qwen2", "llama", "qwen35", "qwen35_moe")
MODEL_DIRS = {"dense": "qwen3_tiny", "moe": "qwen3_moe_tiny", "qwen2": "qwen2_tiny", "llama": "llama_tiny",
              "qwen35": "qwen35_tiny", "qwen35_moe": "qwen35_moe_tiny"}
WARM_START_DIR = "qwen3_tiny_reverse"
WARM_START_TARGET_LOSS = 0.05  # mean response-token cross-entropy over the last 20 steps
WARM_START_MAX_STEPS = 2000
WARM_START_HEAT = 4.0  # output logits divided by this after the warm-start

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
    """The transformers config of a tiny model: 2 layers, hidden 64, query heads 4 of 16.

    ``dense`` / ``moe``: Qwen3 / Qwen3-MoE (q/k norm), GQA 4/2, untied. ``qwen2``: Qwen2 (QKV bias),
    GQA 4/2, tied embeddings. ``llama``: Llama with Llama-3 RoPE scaling (its low/high-frequency
    bands fall inside the 1024 positions), GQA 4/1, untied. ``qwen35`` / ``qwen35_moe``: Qwen3.5's text
    model (dense / MoE with a shared expert), 4 layers (three Gated DeltaNet, one gated full attention,
    Qwen3.5's 3:1 order), GDN 2 key heads / 4 value heads of 16, attention head_dim 32 with partial RoPE 0.25.
    """
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
    if kind == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(intermediate_size=128, **{**common, "tie_word_embeddings": True})
    if kind == "llama":
        from transformers import LlamaConfig

        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return LlamaConfig(intermediate_size=128, rope_parameters=rope, **{**common, "num_key_value_heads": 1})
    if kind in ("qwen35", "qwen35_moe"):
        return _qwen35_config(kind, common)
    raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {MODEL_KINDS}")


def _qwen35_config(kind: str, common: dict):
    hybrid = dict(
        common,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    del hybrid["rope_theta"]
    if kind == "qwen35":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(intermediate_size=128, architectures=["Qwen3_5ForCausalLM"], **hybrid)
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, architectures=["Qwen3_5MoeForCausalLM"], **hybrid)


def build_model(kind: str, seed: int = 0):
    """A tiny model with random weights drawn from ``seed`` (same seed, same weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_model_config(kind)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def build_tokenizer(byte_level: bool = False):
    """A character-level fast tokenizer with Qwen's chat markers; no download.

    ``byte_level``: the same ids, stored as a byte-level BPE without merges (the vocabulary in GPT-2's
    byte alphabet: " " is "Ġ", "\\n" is "Ċ"). transformers loads every ``model_type: qwen2``
    checkpoint's tokenizer as its ``Qwen2Tokenizer``, which rebuilds the tokenizer that way and
    would drop the plain form's space and newline.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    spell = _byte_alphabet() if byte_level else {c: c for c in CHARACTERS}
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + [spell[c] for c in CHARACTERS])}
    assert len(vocab) <= VOCAB_SIZE
    if byte_level:
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
    else:
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


def _byte_alphabet() -> dict[str, str]:
    """Each of :data:`CHARACTERS` as GPT-2's byte-level pre-tokenizer spells it (printable ASCII is
    itself; the other bytes shift past 255 in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    shifted = [b for b in range(256) if b not in printable]
    spelled = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}
    return {c: spelled[ord(c)] for c in CHARACTERS}


def reverse_task(rng: random.Random) -> dict:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
    return {"question": f"Reverse: {word}", "answer": word[::-1]}


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """Fraction of the answer reversed right (verl's ``custom_reward_function`` signature), in [0, 1].

    Characters in the right place, divided by the longer of the response and the answer: a
    response that does not stop where the answer ends loses credit for every extra character.
    The response is what the rollout decoded, cut at the end-of-turn marker if it is still there.
    """
    if not ground_truth:
        return 0.0
    response = solution_str.split("<|im_end|>")[0].strip()
    in_place = sum(a == b for a, b in zip(response, ground_truth))
    return in_place / max(len(response), len(ground_truth))


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


def _prompt_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)


def build_warm_start(seed: int = 0, batch_size: int = 64, lr: float = 1e-2):
    """The demo's policy: the dense tiny model after a supervised warm-start on reversal (module doc).

    Returns ``(model, record)``; ``record`` says how it was made. Fails if the loss target is not
    reached within :data:`WARM_START_MAX_STEPS` steps (a silently under-trained start would make the
    demo show something else).
    """
    import torch

    tokenizer = build_tokenizer()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model = build_model("dense", seed=seed).train()
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one fixed reduction order, whatever the machine's core count
    recent: list[float] = []
    try:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            for step in range(1, WARM_START_MAX_STEPS + 1):
                sequences, targets = [], []
                for _ in range(batch_size):
                    task = reverse_task(rng)
                    prompt = _prompt_ids(tokenizer, task["question"])
                    response = tokenizer.convert_tokens_to_ids(list(task["answer"])) + [eos]
                    sequences.append(prompt + response)
                    targets.append([-100] * len(prompt) + response)
                width = max(map(len, sequences))
                input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
                attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
                labels = torch.tensor([t + [-100] * (width - len(t)) for t in targets])
                loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                recent = (recent + [loss.item()])[-20:]
                if len(recent) == 20 and sum(recent) / 20 < WARM_START_TARGET_LOSS:
                    break
            else:
                raise RuntimeError(
                    f"warm-start did not reach loss {WARM_START_TARGET_LOSS} in {WARM_START_MAX_STEPS} steps "
                    f"(last 20 steps: {sum(recent) / len(recent):.4f})"
                )
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        model.lm_head.weight.div_(WARM_START_HEAT)
    record = {
        "kind": "dense",
        "seed": seed,
        "warm_start_steps": step,
        "warm_start_loss": sum(recent) / len(recent),
        "batch_size": batch_size,
        "lr": lr,
        "heat": WARM_START_HEAT,
    }
    return model.eval(), record


def save_checkpoint(config, directory, seed: int = 11) -> str:
    """A randomly initialised causal LM of ``config`` (bf16, weights drawn from ``seed``) with the tiny
    tokenizer, saved to ``directory``: checkpoints of other shapes for tests and benchmarks."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    build_tokenizer(byte_level=config.model_type == "qwen2").save_pretrained(directory)
    return str(directory)


STAMP = "BUILT"


@functools.cache
def builder_digest() -> str:
    """What built an asset: this module's source and the transformers version that saved it. A
    folder stamped by another builder is stale (its bits may differ) and is built again."""
    import transformers

    source = Path(__file__).read_bytes()
    return hashlib.sha1(source + transformers.__version__.encode()).hexdigest()[:12]


def is_current(folder: Path) -> bool:
    """``folder`` holds an asset stamped by this builder (:func:`builder_digest`)."""
    try:
        return json.loads((folder / STAMP).read_text()).get("builder") == builder_digest()
    except (FileNotFoundError, ValueError, AttributeError):
        return False


def _stamp(folder: Path, record: dict) -> None:
    (folder / STAMP).write_text(json.dumps({**record, "builder": builder_digest()}))


def ensure_assets(root: Path | None = None) -> Path:
    """Build every asset that is missing or stale under ``root`` (default: :func:`default_root`)."""
    root = Path(root) if root is not None else default_root()
    for kind in MODEL_KINDS:
        target = root / MODEL_DIRS[kind]
        if is_current(target):
            continue
        target.mkdir(parents=True, exist_ok=True)
        build_model(kind).save_pretrained(target, safe_serialization=True)
        build_tokenizer(byte_level=kind == "qwen2").save_pretrained(target)
        _stamp(target, {"kind": kind, "seed": 0})
    target = root / WARM_START_DIR
    if not is_current(target):
        target.mkdir(parents=True, exist_ok=True)
        model, record = build_warm_start()
        model.save_pretrained(target, safe_serialization=True)
        build_tokenizer().save_pretrained(target)
        _stamp(target, record)
    data = root / "reverse"
    if not is_current(data):
        build_dataset(data)
        _stamp(data, {"dataset": "reverse"})
    return root
