"""Async single-rollout sampling vs a synchronous batch barrier on an agentic workload: trajectories/s.

Two modes (``--trainer``, required), each comparing the two variants in one run and reporting
trajectories per second delivered to the learner, async / sync:

``--trainer verl`` -- verl 0.9.1's real trainer. Each run is ``python -m verl.trainer.main_ppo`` on
``configs/cpu_tiny_tool_latency`` (sync: verl's sync v1 trainer with the recipe's SyncReplayBuffer) or
``configs/cpu_tiny_tool_latency_async`` (``colocate_async`` with
true_on_policy.verl_adapter.async_sampler); the two configs differ only in those keys
(``common/async_sampler``). Same model (tiny Qwen3, random init), data, B, learner steps and
workload: verl's agent-loop worker runs true_on_policy.verl_adapter.tool_latency_agent -- ``--turns``
generations by the CPU rollout engine with a tool call between consecutive ones, the tool awaiting a
Pareto (``--tool-min-s``, ``--pareto-alpha``) or lognormal latency seeded by (seed, prompt, attempt,
turn), so every prompt's first rollout waits the same in both variants. Times are verl's own
``timing_s/step`` from its file logger (tests/support/verl_run.py runs the trainer and reads it); step 1
(start-up, the first dispatch) is left out of both: throughput = B * (steps - 1) / sum of
``timing_s/step`` over steps 2..steps. Each repeat draws a new workload (seed + repeat) shared by both
variants, and the variants alternate order between repeats.

``--trainer simulation`` -- a SIMULATION, not verl's trainer: the real CPU rollout engine generates,
but the learner step is a sleep (``--learner-ms``) and the scheduling is this script's own; see
:func:`run_variant`.

Usage: python benchmarks/bench_async_sampler.py --trainer verl [--json] [--steps 12] [--repeats 3]
       python benchmarks/bench_async_sampler.py --trainer simulation [--json] [--steps 12] [--batch 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from true_on_policy.transformers_adapter.forwards import patch_transformers

from true_on_policy.kernels import ops
from true_on_policy.rollout.engine import RolloutEngine, SamplingParams, derive_seed
from true_on_policy.rollout.prompt_ledger import PromptLedger, PromptSlot, SlotState, policy_lag
from true_on_policy.tiny_assets import VOCAB_SIZE, build_model, tiny_model_config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))
from verl_run import run_logged  # noqa: E402  (runs verl's trainer and reads its file logger; shared with the tests)

FIRST_REGULAR_TOKEN = 3  # after the tokenizer's special tokens


@dataclasses.dataclass
class Agent:
    prompt_index: int
    attempt: int
    attempt_id: str
    tokens: list[int]
    rng: random.Random  # this attempt's environment: tool latencies
    turn: int = 0
    min_version: int | None = None
    max_version: int | None = None
    started_at: float = 0.0


class Workload:
    """Prompts and tool latencies, a pure function of (prompt index, attempt) and the seed."""

    def __init__(self, args):
        self.args = args

    def prompt(self, prompt_index: int) -> list[int]:
        rng = random.Random(f"{self.args.seed}/prompt/{prompt_index}")
        return [rng.randrange(FIRST_REGULAR_TOKEN, VOCAB_SIZE) for _ in range(self.args.prompt_tokens)]

    def environment(self, prompt_index: int, attempt: int) -> random.Random:
        return random.Random(f"{self.args.seed}/env/{prompt_index}/{attempt}")

    def tool_seconds(self, rng: random.Random) -> float:
        return self.args.tool_ms / 1000.0 * rng.paretovariate(self.args.pareto_alpha)

    def tool_output(self, rng: random.Random) -> list[int]:
        return [rng.randrange(FIRST_REGULAR_TOKEN, VOCAB_SIZE) for _ in range(self.args.tool_tokens)]


def run_variant(policy: str, model, args) -> dict:
    """SIMULATION (``--trainer simulation``): serve agents until the learner has taken ``args.steps`` batches.

    This is a simulation of the sampler's effect, not a measurement of verl's trainer (``--trainer
    verl`` measures that): generation is the real CPU rollout engine, but the learner step is a sleep
    (``--learner-ms``) and the scheduling is this script's own.

    What it measures: trajectories per second delivered to the learner, async / sync, in one run.

    The workload: every trajectory is an agent of ``--turns`` turns. A turn is one generation of up to
    ``--tokens`` tokens by the real CPU rollout engine (:class:`true_on_policy.rollout.engine.RolloutEngine`,
    continuous batching over all agents that are generating, tiny Qwen3 with random weights), followed by
    a simulated tool call whose latency is drawn from a Pareto distribution (shape ``--pareto-alpha``,
    minimum ``--tool-ms``): most calls are quick, a few take many times longer, as real environments do.

    Both variants share everything except the sampling policy:

    - the same engine and model, the same ``--batch`` B, the same number of concurrent agents (B: one
      rollout slot per batch member), the same learner step (``--learner-ms`` of wall time during which
      the engine does not step, as in verl's colocate_async, where generation pauses for the update),
      the same ``--steps`` learner steps, and the same per-trajectory workload: the k-th prompt has the
      same prompt tokens and the same tool latencies in both variants (seeded by k and attempt);
    - **sync**: dispatch B prompts, wait until *all* B trajectories finish (the batch costs its slowest
      member), step, dispatch the next B;
    - **async**: a finished agent's slot takes the next prompt at once, and the learner takes the next B
      trajectories in completion order through :class:`true_on_policy.rollout.prompt_ledger.PromptLedger`, the
      accounting the verl sampler (true_on_policy.verl_adapter.async_sampler) uses, with the same lag
      bound as configs/cpu_tiny_async.yaml (``--max-policy-lag``, drop: a trajectory beyond it is
      re-rolled and counted).

    Throughput = B * steps / wall time until the last learner step ends. Trajectories still in flight
    then are not counted (async's unfinished work is its cost). The variants alternate ``--repeats``
    times, each repeat on a fresh workload (seed + repeat) that both variants share; the ratio is of the
    summed wall times, so load changes on a shared machine hit both.
    """
    return Simulation(policy, model, args).run()


class Simulation:
    """One variant's run of :func:`run_variant`: agents, tool calls, the engine and the learner, stepped in turn."""

    def __init__(self, policy: str, model, args):
        self.policy, self.args, self.batch = policy, args, args.batch
        self.workload = Workload(args)
        eos = tiny_model_config("dense").eos_token_id
        self.engine = RolloutEngine(model, eos_token_id=eos, max_num_seqs=64, max_model_len=args.max_model_len, seed=args.seed)
        self.ledger = PromptLedger(prompts_per_epoch=None)
        self.generating: dict[str, Agent] = {}  # engine request id -> agent
        self.tools: list[tuple[float, int, Agent]] = []  # (ready time, tie-break, agent): agents in a tool call
        self.agents: dict[str, Agent] = {}  # attempt id -> agent, until its trajectory reaches the learner
        self.retry_queue: list[PromptSlot] = []  # prompts awaiting a re-roll (lag drops), oldest first
        self.next_prompt, self.tie = 0, 0
        self.version = 0  # learner steps done = policy version the engine serves
        self.learner_step = 1
        self.step_ends, self.fill_seconds, self.lags, self.trajectory_seconds = [], [], [], []

    def submit_generation(self, agent: Agent) -> None:
        request_id = f"{agent.attempt_id}/turn{agent.turn}"
        # Seeded by the request, not by arrival: the same trajectory samples the same tokens in both variants.
        params = SamplingParams(max_new_tokens=self.args.tokens, temperature=1.0, seed=derive_seed(self.args.seed, request_id))
        self.engine.add_request(request_id, agent.tokens, params)
        self.generating[request_id] = agent

    def start_agent(self, prompt_index: int, attempt: int, now: float, superseded: str | None = None) -> None:
        attempt_id = f"p{prompt_index}a{attempt}"
        agent = Agent(prompt_index, attempt, attempt_id, self.workload.prompt(prompt_index),
                      self.workload.environment(prompt_index, attempt), started_at=now)
        if superseded is None:
            self.ledger.dispatched(attempt_id, prompt_index, self.learner_step, now)
        else:
            self.ledger.requeued(superseded, attempt_id, self.learner_step, now)
        self.agents[attempt_id] = agent
        self.submit_generation(agent)

    def fill_slot(self, now: float) -> None:
        """Start the next rollout in a free agent slot: a re-roll first, else a fresh prompt."""
        if self.retry_queue:
            slot = self.retry_queue.pop(0)
            self.start_agent(slot.prompt_id, slot.attempts + 1, now, superseded=slot.attempt_id)
        else:
            self.start_agent(self.next_prompt, 1, now)
            self.next_prompt += 1

    def return_tools(self, now: float) -> None:
        """Tool calls that returned: next turn, or the trajectory is complete."""
        while self.tools and self.tools[0][0] <= now:
            _, _, agent = heapq.heappop(self.tools)
            agent.turn += 1
            if agent.turn < self.args.turns:
                agent.tokens = agent.tokens + self.workload.tool_output(agent.rng)
                self.submit_generation(agent)
                continue
            self.ledger.completed(agent.attempt_id, agent.min_version, agent.max_version)
            self.trajectory_seconds.append(now - agent.started_at)
            if self.policy == "async":
                self.fill_slot(now)  # the slot is free: no barrier

    def step_engine(self) -> None:
        """One engine step over every agent that is generating."""
        for completion in self.engine.step():
            agent = self.generating.pop(completion.request_id)
            agent.min_version = self.version if agent.min_version is None else agent.min_version
            agent.max_version = self.version
            agent.tokens = agent.tokens + completion.token_ids
            self.tie += 1
            heapq.heappush(self.tools, (time.monotonic() + self.workload.tool_seconds(agent.rng), self.tie, agent))

    def learn(self) -> bool:
        """The learner takes a batch if one is ready (and steps); whether it did."""
        if self.policy == "async":
            decision = self.ledger.take_batch(self.batch, self.learner_step, self.args.max_policy_lag, "drop")
            for slot in decision.dropped_for_lag:
                self.agents.pop(slot.attempt_id)
                self.retry_queue.append(slot)  # its agent slot was refilled already; the re-roll takes the next one
        else:
            all_done = self.ledger.count(SlotState.IN_FLIGHT) == 0 and self.ledger.count(SlotState.COMPLETED) == self.batch
            decision = self.ledger.take_batch(self.batch, self.learner_step) if all_done else None
        if decision is None or not decision.ready:
            return False
        self.fill_seconds.append(time.monotonic() - self.fill_started)
        self.lags.extend(policy_lag(self.learner_step, slot.min_version) for slot in decision.delivered)
        for slot in decision.delivered:
            self.agents.pop(slot.attempt_id)
        time.sleep(self.args.learner_ms / 1000.0)  # the update; the engine does not step meanwhile
        self.version += 1
        self.learner_step += 1
        self.step_ends.append(time.monotonic())
        self.fill_started = self.step_ends[-1]
        if self.policy == "sync" and self.learner_step <= self.args.steps:
            for _ in range(self.batch):
                self.fill_slot(self.step_ends[-1])
        return True

    def run(self) -> dict:
        start = self.fill_started = time.monotonic()
        for _ in range(self.batch):
            self.fill_slot(start)
        while self.learner_step <= self.args.steps:
            self.return_tools(time.monotonic())
            if self.engine.has_work():
                self.step_engine()
            if self.learn():
                continue
            if not self.engine.has_work():
                # Nothing to compute: the agents are all waiting on tools.
                wait = (self.tools[0][0] - time.monotonic()) if self.tools else 0.001
                time.sleep(max(0.0, min(wait, 0.05)))
        return self.result(start)

    def result(self, start: float) -> dict:
        self.ledger.check_invariants()
        elapsed = self.step_ends[-1] - start
        delivered = self.batch * self.args.steps
        return {
            "seconds": elapsed,
            "trajectories": delivered,
            "trajectories_per_second": delivered / elapsed,
            "fill_seconds_mean": statistics.fmean(self.fill_seconds),
            "fill_seconds_max": max(self.fill_seconds),
            "trajectory_seconds_mean": statistics.fmean(self.trajectory_seconds),
            "policy_lag_mean": statistics.fmean(self.lags),
            "policy_lag_max": max(self.lags),
            "rerolled_for_lag": self.ledger.requeues.get("policy_lag", 0),
            "unfinished_rollouts_at_end": self.ledger.count(SlotState.IN_FLIGHT) + self.ledger.count(SlotState.COMPLETED),
        }


def simulation_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_async_sampler.py --trainer simulation", description="SIMULATION: " + __doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="B: trajectories per learner step (and agents)")
    parser.add_argument("--steps", type=int, default=12, help="learner steps per variant")
    parser.add_argument("--turns", type=int, default=3, help="generation + tool call turns per trajectory")
    parser.add_argument("--tokens", type=int, default=8, help="max new tokens per generation")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--tool-tokens", type=int, default=4, help="tokens a tool call appends")
    parser.add_argument("--tool-ms", type=float, default=30.0, help="Pareto minimum of a tool call's latency")
    parser.add_argument("--pareto-alpha", type=float, default=1.5, help="Pareto shape; smaller = heavier tail")
    parser.add_argument("--learner-ms", type=float, default=50.0, help="wall time of one learner step")
    parser.add_argument("--max-policy-lag", type=int, default=2, help="async lag bound (drop), as cpu_tiny_async")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="sync/async pairs, alternated, one workload each")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one record per line (case, times, ratio)")
    args = parser.parse_args(argv)
    for name in ("batch", "steps", "turns", "tokens", "prompt_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.pareto_alpha <= 1.0:
        parser.error("--pareto-alpha must be > 1 (the mean latency must be finite)")
    if args.prompt_tokens + args.turns * (args.tokens + args.tool_tokens) >= args.max_model_len:
        parser.error("--max-model-len is too small for prompt + turns * (tokens + tool tokens)")
    return args


def summary(results: list[dict]) -> dict:
    """One variant's repeats together: summed times and counts, means of means, the largest maxima."""
    seconds = sum(r["seconds"] for r in results)
    trajectories = sum(r["trajectories"] for r in results)
    return {
        "trajectories_per_second": trajectories / seconds,
        "seconds": seconds,
        "trajectories": trajectories,
        "fill_seconds_mean": statistics.fmean(r["fill_seconds_mean"] for r in results),
        "fill_seconds_max": max(r["fill_seconds_max"] for r in results),
        "trajectory_seconds_mean": statistics.fmean(r["trajectory_seconds_mean"] for r in results),
        "policy_lag_mean": statistics.fmean(r["policy_lag_mean"] for r in results),
        "policy_lag_max": max(r["policy_lag_max"] for r in results),
        "rerolled_for_lag": sum(r["rerolled_for_lag"] for r in results),
        "unfinished_rollouts_at_end": sum(r["unfinished_rollouts_at_end"] for r in results),
        "per_repeat_trajectories_per_second": [round(r["trajectories_per_second"], 3) for r in results],
    }


def main_simulation(argv: list[str]) -> dict:
    args = simulation_args(argv)
    load_before = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    # The engine's forward as configs/cpu_tiny runs it (true_on_policy.deterministic=true).
    patch_transformers()
    ops.set_switches(consistent=True)
    model = build_model("dense", seed=args.seed)
    runs = {"sync": [], "async": []}
    # Warm-up (kernels, allocator) on a workload of its own.
    run_variant("sync", model, argparse.Namespace(**{**vars(args), "steps": 1, "seed": args.seed - 1}))
    for repeat in range(args.repeats):
        # Each repeat draws a new workload (more of the latency tail); both variants get that same one.
        repeat_args = argparse.Namespace(**{**vars(args), "seed": args.seed + repeat})
        for policy in ("sync", "async"):
            runs[policy].append(run_variant(policy, model, repeat_args))

    sync, asynchronous = summary(runs["sync"]), summary(runs["async"])
    report = {
        "benchmark": "async single-rollout sampler vs synchronous batch barrier",
        "measures": (
            "trajectories/s delivered to the learner (B * steps / wall time to the last learner step), "
            "agentic workload: real CPU rollout engine generation + Pareto-latency tool call per turn; "
            "variants differ only in the sampling policy (same engine, B, agent slots, learner step, workload)"
        ),
        "ratio_async_over_sync": asynchronous["trajectories_per_second"] / sync["trajectories_per_second"],
        "per_repeat_ratio": [
            round(a["trajectories_per_second"] / b["trajectories_per_second"], 3)
            for a, b in zip(runs["async"], runs["sync"], strict=True)
        ],
        "goal": ">= 2.0",
        "async": asynchronous,
        "sync": sync,
        # Generation is CPU-bound and the tool latency is not, so a busy machine shifts the balance
        # toward generation (which both variants pay alike) and lowers the ratio.
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0], "cpus": os.cpu_count()},
        "settings": vars(args),
        "command": " ".join(shlex.quote(part) for part in [sys.executable, *sys.argv]),
    }
    if args.json:  # one record per repeat and one for all, in the benchmarks' common record shape
        for i, (a, b) in enumerate(zip(runs["async"], runs["sync"], strict=True)):
            print(json.dumps(_record(f"async_sampler/simulation/repeat{i}", a, b, simulation=True)))
        print(json.dumps(_record("async_sampler/simulation", asynchronous, sync, simulation=True)))
    else:
        print(json.dumps(report, indent=2))
    return report


def _record(case: str, asynchronous: dict, sync: dict, simulation: bool) -> dict:
    """The common record: ``case``, both variants' seconds and trajectories/s, ``ratio`` (async/sync)."""
    return {
        "case": case,
        "simulation": simulation,  # True: the learner step is a sleep, not verl's trainer
        "async_s": round(asynchronous["seconds"], 3),
        "sync_s": round(sync["seconds"], 3),
        "async_traj_per_s": round(asynchronous["trajectories_per_second"], 3),
        "sync_traj_per_s": round(sync["trajectories_per_second"], 3),
        "ratio": round(asynchronous["trajectories_per_second"] / sync["trajectories_per_second"], 3),
    }


# ---------------------------------------------------------------------------------------------- --trainer verl
VERL_CONFIGS = {"sync": "cpu_tiny_tool_latency", "async": "cpu_tiny_tool_latency_async"}
AGENT_LOOP_REGISTRY = REPO / "configs" / "agent_loops" / "tool_latency_agent.yaml"
TOOL_CONFIG = REPO / "configs" / "tools" / "latency_tool.yaml"
SAMPLER = "flashreinforce/sampler"


def verl_workload_files(args, seed: int, directory: Path) -> list[str]:
    """The shipped agent-loop and tool configs with this run's workload settings; their overrides."""
    from omegaconf import OmegaConf

    from true_on_policy.verl_adapter.tool_latency_agent import parse_tool_config

    registry = OmegaConf.load(AGENT_LOOP_REGISTRY)
    registry[0].turns, registry[0].tokens_per_turn = args.turns, args.tokens_per_turn
    tools = OmegaConf.load(TOOL_CONFIG)
    tool = tools.tools[0].config
    tool.distribution, tool.min_s, tool.alpha, tool.sigma, tool.seed = (
        args.distribution, args.tool_min_s, args.pareto_alpha, args.lognormal_sigma, seed
    )
    parse_tool_config(OmegaConf.to_container(tool))  # a bad flag fails here, not in a Ray worker
    registry_path, tool_path = directory / "agent_loops.yaml", directory / "tools.yaml"
    OmegaConf.save(registry, registry_path)
    OmegaConf.save(tools, tool_path)
    return [
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={registry_path}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_path}",
    ]


def run_verl_variant(policy: str, args, seed: int) -> dict:
    """One ``python -m verl.trainer.main_ppo`` run of ``policy``'s config; its numbers from verl's file logger."""
    with tempfile.TemporaryDirectory(prefix="bench_async_verl_") as scratch:
        scratch = Path(scratch)
        overrides = [
            f"trainer.total_training_steps={args.steps}",
            f"data.train_batch_size={args.batch}",
            f"hydra.run.dir={scratch / 'hydra'}",
            *verl_workload_files(args, seed, scratch),
        ]
        if args.max_response_length is not None:
            overrides.append(f"data.max_response_length={args.max_response_length}")
        if policy == "async" and args.warmup_batches is not None:
            overrides.append(f"trainer.v1.colocate_async.num_warmup_batches={args.warmup_batches}")
        if policy == "async" and args.max_policy_lag == "null":  # no bound: no strategy either (async_sampler)
            overrides += [
                "trainer.v1.sampler.sampler_kwargs.max_policy_lag=null",
                "~trainer.v1.sampler.sampler_kwargs.lag_strategy",
            ]
        elif policy == "async" and args.max_policy_lag is not None:
            overrides.append(f"trainer.v1.sampler.sampler_kwargs.max_policy_lag={int(args.max_policy_lag)}")
        started = time.monotonic()
        steps = run_logged(VERL_CONFIGS[policy], scratch / "metrics.jsonl", *overrides, timeout=args.timeout)
        wall = time.monotonic() - started
    if sorted(steps) != list(range(1, args.steps + 1)):
        raise RuntimeError(f"{policy}: verl's file logger has steps {sorted(steps)}, expected 1..{args.steps}")
    timed = [steps[step] for step in range(2, args.steps + 1)]  # step 1: start-up and the first dispatch
    seconds = sum(metrics["timing_s/step"] for metrics in timed)
    trajectories = args.batch * len(timed)
    result = {
        "seconds": seconds,
        "trajectories": trajectories,
        "trajectories_per_second": trajectories / seconds,
        "step_s": [round(metrics["timing_s/step"], 3) for metrics in timed],
        "gen_s_mean": statistics.fmean(metrics["timing_s/gen"] for metrics in timed),
        "learner_s_mean": statistics.fmean(
            sum(metrics.get(f"timing_s/{part}", 0.0) for part in ("old_log_prob", "adv", "update_actor", "update_weights"))
            for metrics in timed
        ),
        "num_turns_mean": statistics.fmean(metrics["training/num_turns/mean"] for metrics in timed),
        "run_wall_s": wall,  # the whole process: Ray and worker start-up included; not in the ratio
    }
    if policy == "async":
        result.update(
            policy_lag_mean=statistics.fmean(metrics[f"{SAMPLER}/policy_lag/mean"] for metrics in timed),
            policy_lag_max=max(metrics[f"{SAMPLER}/policy_lag/max"] for metrics in timed),
            requeued_policy_lag=sum(metrics[f"{SAMPLER}/requeued/policy_lag"] for metrics in steps.values()),
        )
    return result


def main_verl(argv: list[str]) -> list[dict]:
    parser = argparse.ArgumentParser(prog="bench_async_sampler.py --trainer verl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="learner steps per run (step 1 is not timed)")
    parser.add_argument("--batch", type=int, default=8, help="B: data.train_batch_size (trajectories per learner step)")
    parser.add_argument("--repeats", type=int, default=3, help="sync/async pairs, alternating order, one workload each")
    parser.add_argument("--turns", type=int, default=3, help="generations per trajectory (a tool call between two)")
    parser.add_argument("--tokens-per-turn", type=int, default=4, help="max new tokens per generation")
    parser.add_argument("--max-response-length", type=int, help="data.max_response_length (default: the config's)")
    parser.add_argument("--distribution", choices=("pareto", "lognormal"), default="pareto")
    parser.add_argument("--tool-min-s", type=float, default=0.3, help="Pareto minimum / lognormal median, seconds")
    parser.add_argument("--pareto-alpha", type=float, default=1.5, help="Pareto shape; smaller = heavier tail")
    parser.add_argument("--lognormal-sigma", type=float, default=1.0)
    parser.add_argument(
        "--warmup-batches", type=float, help="async: num_warmup_batches, batches in flight ahead of the learner (default: the config's)"
    )
    parser.add_argument(
        "--max-policy-lag", type=lambda v: v if v == "null" else int(v), help="async: lag bound (drop), or null (default: the config's)"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed of repeat 0 (repeat r uses seed + r)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per trainer run")
    parser.add_argument("--json", action="store_true", help="print one record per line (case, times, ratio)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (step 1 is not timed), got {args.steps}")
    for name in ("batch", "repeats", "turns", "tokens_per_turn"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for repeat in range(args.repeats):
        for policy in ("sync", "async") if repeat % 2 == 0 else ("async", "sync"):
            result = run_verl_variant(policy, args, seed=args.seed + repeat)
            runs[policy].append(result)
            progress = {"policy": policy, "repeat": repeat, **result}
            print(json.dumps(progress), file=sys.stderr, flush=True)  # partial results survive a kill

    def summary(results: list[dict]) -> dict:
        seconds = sum(r["seconds"] for r in results)
        return {"seconds": seconds, "trajectories_per_second": sum(r["trajectories"] for r in results) / seconds}

    context = {
        "trainer": "verl",
        "steps_timed": args.steps - 1,
        "batch": args.batch,
        "load_average": {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()},
    }
    records = []
    for repeat, (a, b) in enumerate(zip(runs["async"], runs["sync"], strict=True)):
        record = _record(f"async_sampler/verl/repeat{repeat}", a, b, simulation=False)
        detail = {f"{policy}_{key}": value for policy, r in (("async", a), ("sync", b)) for key, value in r.items()
                  if key not in ("seconds", "trajectories_per_second")}
        records.append({**record, "seed": args.seed + repeat, **detail})
    records.append({**_record("async_sampler/verl", summary(runs["async"]), summary(runs["sync"]), simulation=False),
                    "per_repeat_ratio": [r["ratio"] for r in records], **context,
                    "settings": vars(args),
                    "command": " ".join(shlex.quote(part) for part in [sys.executable, *sys.argv])})
    for record in records:
        print(json.dumps(record) if args.json else json.dumps(record, indent=2), flush=True)
    return records


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument(
        "--trainer",
        choices=("verl", "simulation"),
        required=True,
        help="verl: verl's real trainer, sync vs colocate_async; simulation: the CPU engine + a sleep as the learner step",
    )
    known, rest = parser.parse_known_args(argv)
    return main_verl(rest) if known.trainer == "verl" else main_simulation(rest)


if __name__ == "__main__":
    main()
