"""The async-sampler benchmark's agentic workload (true_on_policy.verl_adapter.tool_latency_agent): the tool
without Ray -- its latency a pure function of its key, its config errors, its await (in verl's real trainer:
tests/e2e/test_tool_latency_agent_e2e.py).
"""

from __future__ import annotations

import asyncio
import random
import re
import time

import pytest
from omegaconf import OmegaConf

from true_on_policy.verl_adapter.tool_latency_agent import LatencyTool, parse_tool_config, tool_answer, tool_latency_s
from verl_run import REPO

TOOL_CONFIG = REPO / "configs" / "tools" / "latency_tool.yaml"


def _tool(**config) -> LatencyTool:
    shipped = OmegaConf.to_container(OmegaConf.load(TOOL_CONFIG).tools[0], resolve=True)
    from verl.tools.schemas import OpenAIFunctionToolSchema

    return LatencyTool({**shipped["config"], **config}, OpenAIFunctionToolSchema.model_validate(shipped["tool_schema"]))


KEYS = [(prompt, attempt, turn) for prompt in range(50) for attempt in (1, 2) for turn in (0, 1)]


def draws_are_a_function_of_their_key(latency) -> bool:
    """Not a stream: the draws in another order, with the process's own random state moved between
    them, are the same numbers (a generator shared across calls, or the global one, would not be)."""
    in_order = [latency(*key) for key in KEYS]
    again = {}
    for key in random.Random(0).sample(KEYS, len(KEYS)):
        random.random()
        again[key] = latency(*key)
    return [again[key] for key in KEYS] == in_order


def test_twin_a_latency_drawn_from_a_shared_generator_is_not_a_function_of_its_key():
    shared = random.Random(7)
    assert not draws_are_a_function_of_their_key(lambda prompt, attempt, turn: 0.3 * shared.paretovariate(1.5))
    assert not draws_are_a_function_of_their_key(lambda prompt, attempt, turn: 0.3 * random.paretovariate(1.5))


def test_latency_is_a_pure_function_of_seed_prompt_attempt_and_turn():
    settings = parse_tool_config({"min_s": 0.3, "alpha": 1.5, "seed": 7})
    draws = [tool_latency_s(settings, *key) for key in KEYS]
    assert draws_are_a_function_of_their_key(lambda *key: tool_latency_s(settings, *key))
    # The same in every process and trainer mode (the e2e test compares two runs' tool waits):
    # pinned values, exact.
    assert [draws[0], tool_latency_s(settings, 49, 2, 1), tool_latency_s(settings, 3, 1, 1)] == [
        0.38835279557314767, 0.503456050444353, 0.6886931734944188]
    assert min(draws) >= 0.3 and len(set(draws)) == len(draws)
    assert tool_latency_s({**settings, "seed": 8}, 0, 1, 0) != tool_latency_s(settings, 0, 1, 0)
    lognormal = parse_tool_config({"distribution": "lognormal", "min_s": 0.3, "sigma": 1.0})
    assert tool_latency_s(lognormal, 3, 1, 0) > 0


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"distribution": "uniform"}, "config.distribution"),
        ({"min_s": 0}, "config.min_s"),
        ({"alpha": 1.0}, "config.alpha"),  # a Pareto shape <= 1 has no finite mean
        ({"seed": "0"}, "config.seed"),
        ({"latency": 1}, "unknown key(s) ['latency']"),
    ],
)
def test_a_bad_tool_config_is_an_error_naming_key_and_value(config, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        parse_tool_config(config)


def test_the_tool_awaits_its_latency_and_a_reroll_draws_afresh():
    tool = _tool(min_s=0.02, alpha=3.0, seed=1)

    async def session(prompt_index: int):
        instance, _ = await tool.create(create_kwargs={"prompt_index": prompt_index})
        started = time.monotonic()
        answer, _, metrics = await tool.execute(instance, {"turn": 0})
        await tool.release(instance)
        return answer.text, metrics["latency_s"], time.monotonic() - started

    first, latency, waited = asyncio.run(session(5))
    assert first == tool_answer(5, 1, 0, tool_latency_s(tool.settings, 5, 1, 0)) and waited >= latency
    again, _, _ = asyncio.run(session(5))  # the same prompt rolled out again: attempt 2, a new draw
    assert again == tool_answer(5, 2, 0, tool_latency_s(tool.settings, 5, 2, 0)) and again != first
    with pytest.raises(ValueError, match="prompt_index"):
        asyncio.run(tool.create(create_kwargs={}))
