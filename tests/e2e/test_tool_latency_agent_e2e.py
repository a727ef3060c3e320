"""The async-sampler benchmark's agentic workload (true_on_policy.verl_adapter.tool_latency_agent) in verl's
real trainer (the tool itself, without Ray: tests/unit/test_tool_latency_agent.py).

The test runs verl's real trainer twice on the same workload -- ``cpu_tiny_tool_latency`` (sync)
and ``cpu_tiny_tool_latency_async`` (colocate_async + the single-rollout sampler), as
``benchmarks/bench_async_sampler.py --trainer verl`` does -- and reads the step metrics from verl's
file logger and each delivered trajectory from verl's rollout dump (``trainer.rollout_data_dir``, one
JSONL per step). The tool's answers, which the agent loop puts in the trajectory, name the prompt,
attempt, turn and the latency the tool awaited.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from true_on_policy.verl_adapter.tool_latency_agent import parse_tool_config, tool_latency_s
from verl_run import REPO, Run, train_steps

TOOL_CONFIG = REPO / "configs" / "tools" / "latency_tool.yaml"
STEPS, BATCH, TURNS = 3, 8, 3  # B: data.train_batch_size of common/cpu_tiny; TURNS: agent_loops/tool_latency_agent.yaml
ANSWER = re.compile(r"p(\d+) a(\d+) t(\d+) (\d+\.\d{3})s")


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
