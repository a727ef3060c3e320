"""The async-sampler benchmark's agentic workload (true_on_policy.verl_adapter.tool_latency_agent) in verl.

The e2e test runs verl's real trainer twice on the same workload -- ``cpu_tiny_tool_latency`` (sync)
and ``cpu_tiny_tool_latency_async`` (colocate_async + the single-rollout sampler), as
``benchmarks/bench_async_sampler.py --trainer verl`` does -- and reads the step metrics from verl's
file logger and each delivered trajectory from verl's rollout dump (``trainer.rollout_data_dir``, one
JSONL per step). The tool's answers, which the agent loop puts in the trajectory, name the prompt,
attempt, turn and the latency the tool awaited. The unmarked tests check the tool without Ray.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from true_on_policy.verl_adapter.tool_latency_agent import LatencyTool, parse_tool_config, tool_answer, tool_latency_s
from verl_run import REPO, Run, train_steps

TOOL_CONFIG = REPO / "configs" / "tools" / "latency_tool.yaml"
STEPS, BATCH, TURNS = 3, 8, 3  # B: data.train_batch_size of common/cpu_tiny; TURNS: agent_loops/tool_latency_agent.yaml
ANSWER = re.compile(r"p(\d+) a(\d+) t(\d+) (\d+\.\d{3})s")


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


def _trajectories(dump_dir: Path) -> dict[int, list[list[tuple[int, int, int, float]]]]:
    """Per step, each delivered trajectory's tool answers (prompt, attempt, turn, latency), from verl's dump."""
    steps = {}
    for path in sorted(dump_dir.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        steps[int(path.stem)] = [
            [(int(p), int(a), int(t), float(s)) for p, a, t, s in ANSWER.findall(row["output"])] for row in rows
        ]
    return steps


def _fast_tools():
    tools = OmegaConf.load(TOOL_CONFIG)
    tools.tools[0].config.min_s = 0.1  # the shipped Pareto(1.5) shape, a tenth of a second minimum
    return tools


def _tool_latency_run(config: str) -> Run:
    """``config`` for STEPS steps with the fast tools, each delivered trajectory dumped to ``dump/``."""
    return Run(
        config,
        train_steps(STEPS)
        + (
            "actor_rollout_ref.rollout.multi_turn.tool_config_path={run_dir}/tools.yaml",
            "trainer.rollout_data_dir={run_dir}/dump",
        ),
        files=(("tools.yaml", OmegaConf.to_yaml(_fast_tools())),),
    )


TOOL_RUNS = {"sync": _tool_latency_run("cpu_tiny_tool_latency"), "async": _tool_latency_run("cpu_tiny_tool_latency_async")}


@pytest.mark.e2e
def test_sync_and_async_trainers_run_the_same_seeded_tool_latencies_and_deliver_distinct_prompts(verl_runs):
    settings = parse_tool_config(OmegaConf.to_container(_fast_tools().tools[0].config))
    delivered, gen_s, first_attempts = {}, {}, {}
    for policy, run in TOOL_RUNS.items():
        result = verl_runs(run)
        steps = result.metrics
        assert sorted(steps) == list(range(1, STEPS + 1))
        trajectories = _trajectories(result.directory / "dump")
        assert sorted(trajectories) == list(range(1, STEPS + 1))
        for step, batch in trajectories.items():
            assert len(batch) == BATCH
            for answers in batch:
                # Every trajectory made its TURNS - 1 tool calls, in order, for one prompt and attempt, and
                # each awaited the latency the pure function gives that (prompt, attempt, turn).
                assert [turn for _, _, turn, _ in answers] == list(range(TURNS - 1)), answers
                assert len({(prompt, attempt) for prompt, attempt, _, _ in answers}) == 1, answers
                for prompt, attempt, turn, latency in answers:
                    assert latency == round(tool_latency_s(settings, prompt, attempt, turn), 3)
            # verl counts the turns: a prompt, then TURNS generations with a tool message between each two.
            assert steps[step]["training/num_turns/min"] == 2 * TURNS
        delivered[policy] = [answers[0][0] for step in sorted(trajectories) for answers in trajectories[step]]
        first_attempts[policy] = {answers[0][0]: answers for batch in trajectories.values() for answers in batch if answers[0][1] == 1}
        gen_s[policy] = {step: steps[step]["timing_s/gen"] for step in steps}
        # One rollout per prompt reaches the learner: B * steps distinct prompts, none twice.
        assert len(set(delivered[policy])) == BATCH * STEPS, delivered[policy]
        if policy == "sync":
            # The batch barrier: each step's generation lasts at least its slowest trajectory's tool waits.
            for step, batch in trajectories.items():
                slowest = max(sum(latency for *_, latency in answers) for answers in batch)
                assert gen_s[policy][step] >= slowest - 1e-3, (step, gen_s[policy][step], slowest)
        else:
            for step, metrics in steps.items():
                assert metrics["flashreinforce/sampler/distinct_prompts"] == BATCH
                assert metrics["flashreinforce/sampler/epoch_delivered"] == step * BATCH
    # Both trainers read the dataset in the same order (data.seed), so most prompts reach both learners;
    # a prompt's first rollout waited exactly the same in both.
    common = set(first_attempts["sync"]) & set(first_attempts["async"])
    assert len(common) >= BATCH, (delivered["sync"], delivered["async"])
    assert all(first_attempts["sync"][prompt] == first_attempts["async"][prompt] for prompt in common)
