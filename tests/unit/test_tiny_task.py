"""The demo's task: the reversal reward and the warm-started policy it starts from (true_on_policy.tiny_assets)."""

import json
import random

import pytest
import torch

from true_on_policy import tiny_assets


@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [
        ("cba", "cba", 1.0),
        ("cba<|im_end|>", "cba", 1.0),  # the end-of-turn marker, if the decode kept it, ends the response
        (" cba ", "cba", 1.0),
        ("cbx", "cba", 2 / 3),
        ("abc", "cba", 1 / 3),  # only the middle character is in place
        ("cbacba", "cba", 3 / 6),  # not stopping costs credit for every extra character
        ("cb", "cba", 2 / 3),
        ("", "cba", 0.0),
        ("cba", "", 0.0),
    ],
)
def test_reward_is_the_fraction_reversed_right(response, answer, score):
    assert tiny_assets.compute_score(tiny_assets.DATA_SOURCE, response, answer) == pytest.approx(score)


@pytest.fixture(scope="module")
def warm_start():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_assets.ensure_assets() / tiny_assets.WARM_START_DIR
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path), json.loads((path / tiny_assets.STAMP).read_text())


def mean_reward(model, tokenizer, greedy: bool, n: int = 48, max_new_tokens: int = 12) -> tuple[float, float]:
    """Mean reward and fraction of responses that end with EOS, on fresh tasks."""
    rng, generator = random.Random(7), torch.Generator().manual_seed(7)
    rewards, ended = [], 0
    for _ in range(n):
        task = tiny_assets.reverse_task(rng)
        ids = tiny_assets._prompt_ids(tokenizer, task["question"])
        out: list[int] = []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = model(input_ids=torch.tensor([ids + out])).logits[0, -1]
                token = int(logits.argmax()) if greedy else int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
                if token == tokenizer.eos_token_id:
                    ended += 1
                    break
                out.append(token)
        rewards.append(tiny_assets.compute_score(tiny_assets.DATA_SOURCE, tokenizer.decode(out), task["answer"]))
    return sum(rewards) / n, ended / n


def test_warm_start_knows_the_task_but_samples_hot(warm_start):
    """What the demo's RL has to do: greedy decoding already reverses; sampling at temperature 1 does not."""
    model, tokenizer, record = warm_start
    assert record["warm_start_loss"] < tiny_assets.WARM_START_TARGET_LOSS
    greedy, greedy_ended = mean_reward(model, tokenizer, greedy=True)
    sampled, sampled_ended = mean_reward(model, tokenizer, greedy=False)
    assert greedy > 0.9 and greedy_ended == 1.0
    assert sampled < 0.6
    assert 0.0 < sampled_ended < 1.0  # some responses stop, some do not: lengths vary


def test_an_asset_stamped_by_another_builder_is_built_again(tmp_path):
    """The stamp names its builder (this module's source and the transformers version): the shipped
    assets are current; the same folder stamped by another builder, or unstamped, is not."""
    for folder in (tiny_assets.MODEL_DIRS["dense"], tiny_assets.WARM_START_DIR, "reverse"):
        assert tiny_assets.is_current(tiny_assets.ensure_assets() / folder), folder
    stale = tmp_path / "asset"
    stale.mkdir()
    assert not tiny_assets.is_current(stale)
    (stale / tiny_assets.STAMP).write_text(json.dumps({"kind": "dense", "seed": 0}))  # before builders were named
    assert not tiny_assets.is_current(stale)
    (stale / tiny_assets.STAMP).write_text(json.dumps({"builder": tiny_assets.builder_digest()}))
    assert tiny_assets.is_current(stale)
