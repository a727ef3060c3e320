"""The text model of a Qwen3.5 vision-language checkpoint: the checkpoint the recipe trains and serves.

    python examples/qwen35_35b_a3b/text_model.py SRC DST

SRC: a local ``Qwen3_5MoeForConditionalGeneration`` (or dense ``Qwen3_5ForConditionalGeneration``) checkpoint,
e.g. a download of Qwen/Qwen3.5-35B-A3B, which ``check`` refuses by name (a vision-language checkpoint). DST (a
new directory): ``config.json`` is SRC's ``text_config`` naming the text model's class; every other file of SRC
(weight shards and their index, tokenizer, chat template, generation config) is linked, not copied.
transformers loads the text model from the vision-language weight names (its conversion mapping for the text
model types drops the ``model.language_model`` prefix; the vision tower's and MTP weights are ignored by name);
vLLM under verl reads no weights (``load_format: dummy``; verl syncs them from training each step).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# vision-language architecture -> its text model's (architecture, model_type), as the architecture table names them
TEXT_MODELS = {
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
}


def text_config(config: dict) -> dict:
    """The text model's config.json of a vision-language ``config``; ValueError naming what is not one."""
    architectures = config.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in TEXT_MODELS or "text_config" not in config:
        raise ValueError(f"text_model: architectures={architectures} with text_config "
                         f"{'present' if 'text_config' in config else 'absent'} is not one of {sorted(TEXT_MODELS)}")
    architecture, model_type = TEXT_MODELS[architectures[0]]
    text = dict(config["text_config"])
    if text.get("model_type", model_type) != model_type:
        raise ValueError(f"text_model: text_config.model_type={text['model_type']!r}, expected {model_type!r}")
    # the head's tie is the vision-language model's key (transformers reads it there); the text model has its own
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return {**text, "architectures": [architecture], "model_type": model_type}


def make_text_model(source: Path, target: Path) -> Path:
    """Write ``target`` (a new directory): the text model's config.json and a link to every other file of ``source``."""
    config = json.loads((source / "config.json").read_text())
    text = text_config(config)
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps(text, indent=2) + "\n")
    for entry in sorted(source.iterdir()):
        if entry.name != "config.json":
            os.symlink(entry.resolve(), target / entry.name)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="a local Qwen3.5 vision-language checkpoint")
    parser.add_argument("target", type=Path, help="the text model's directory (must not exist)")
    args = parser.parse_args()
    print(make_text_model(args.source, args.target))


if __name__ == "__main__":
    main()
