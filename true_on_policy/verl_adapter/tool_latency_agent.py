"""A multi-turn verl agent loop whose tool call has a heavy-tailed latency (the async benchmark's workload).

- :class:`LatencyTool`, a verl ``BaseTool`` (``configs/tools/latency_tool.yaml``): each ``execute``
  awaits a Pareto or lognormal latency that is a pure function of (seed, prompt, attempt, turn), so a
  prompt's first rollout waits the same in every run and trainer mode, and a re-roll draws afresh.
- :class:`ToolLatencyAgentLoop`, a verl ``AgentLoopBase`` (``configs/agent_loops/tool_latency_agent.yaml``):
  ``turns`` short generations with a tool call between consecutive ones, the answer joining the
  context as a ``tool`` message (response mask 0), as verl's ``ToolAgentLoop`` does.

It lives in the package, not in ``benchmarks/``, because verl's Ray agent-loop workers import it by
dotted path.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, ToolListWrap
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse
from verl.utils.profiler import simple_timer

DISTRIBUTIONS = ("pareto", "lognormal")
TOOL_CONFIG_DEFAULTS = {"type": "native", "distribution": "pareto", "min_s": 0.3, "alpha": 1.5, "sigma": 1.0, "seed": 0}


def parse_tool_config(config: dict) -> dict:
    """The tool's ``config:`` mapping over its defaults; an unknown key or a bad value is an error naming it."""
    given = dict(config or {})
    unknown = sorted(set(given) - set(TOOL_CONFIG_DEFAULTS))
    if unknown:
        raise ValueError(f"{LatencyTool.__name__} config has unknown key(s) {unknown}; known: {sorted(TOOL_CONFIG_DEFAULTS)}")
    settings = {**TOOL_CONFIG_DEFAULTS, **given}
    if settings["distribution"] not in DISTRIBUTIONS:
        raise ValueError(f"{LatencyTool.__name__} config.distribution must be one of {DISTRIBUTIONS}, got {settings['distribution']!r}")
    for key, bound in (("min_s", 0.0), ("alpha", 1.0), ("sigma", 0.0)):
        value = settings[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > bound:
            raise ValueError(f"{LatencyTool.__name__} config.{key} must be a number > {bound}, got {value!r}")
    if isinstance(settings["seed"], bool) or not isinstance(settings["seed"], int):
        raise ValueError(f"{LatencyTool.__name__} config.seed must be an int, got {settings['seed']!r}")
    return settings


def tool_latency_s(settings: dict, prompt_index: int, attempt: int, turn: int) -> float:
    """Seconds the tool waits: a pure function of the settings, the prompt, the attempt and the turn."""
    rng = random.Random(f"{settings['seed']}/{prompt_index}/{attempt}/{turn}")
    if settings["distribution"] == "pareto":
        return settings["min_s"] * rng.paretovariate(settings["alpha"])
    return settings["min_s"] * math.exp(rng.gauss(0.0, settings["sigma"]))


def tool_answer(prompt_index: int, attempt: int, turn: int, latency_s: float) -> str:
    return f"p{prompt_index} a{attempt} t{turn} {latency_s:.3f}s"


class LatencyTool(BaseTool):
    """A stateful verl tool whose ``execute`` awaits a seeded heavy-tailed latency (see the module doc)."""

    def __init__(self, config: dict, tool_schema):
        self.settings = parse_tool_config(config)
        super().__init__(config, tool_schema)
        self._sessions: dict[str, tuple[int, int]] = {}  # instance id -> (prompt index, attempt)
        self._attempts: Counter = Counter()  # prompt index -> sessions opened

    async def create(self, instance_id: str | None = None, create_kwargs: dict | None = None, **kwargs):
        prompt_index = (create_kwargs or {}).get("prompt_index")
        if isinstance(prompt_index, bool) or not isinstance(prompt_index, int):
            raise ValueError(f"{type(self).__name__}.create needs create_kwargs['prompt_index'] (an int), got {prompt_index!r}")
        instance_id = instance_id or uuid4().hex
        self._attempts[prompt_index] += 1
        self._sessions[instance_id] = (prompt_index, self._attempts[prompt_index])
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        if instance_id not in self._sessions:
            raise KeyError(f"{type(self).__name__}: no open session {instance_id!r} (create() it first)")
        turn = parameters.get("turn")
        if isinstance(turn, bool) or not isinstance(turn, int) or turn < 0:
            raise ValueError(f"{type(self).__name__}.execute needs parameters['turn'] (an int >= 0), got {turn!r}")
        prompt_index, attempt = self._sessions[instance_id]
        latency = tool_latency_s(self.settings, prompt_index, attempt, turn)
        await asyncio.sleep(latency)
        return ToolResponse(text=tool_answer(prompt_index, attempt, turn, latency)), 0.0, {"latency_s": latency}

    async def release(self, instance_id: str, **kwargs) -> None:
        self._sessions.pop(instance_id, None)


class ToolLatencyAgentLoop(AgentLoopBase):
    """``turns`` generations with a :class:`LatencyTool` call between consecutive ones (see the module doc)."""

    def __init__(self, *args, tools: ToolListWrap | None = None, turns: int, tokens_per_turn: int, tool_name: str = "latency", **kwargs):
        super().__init__(*args, **kwargs)
        for key, value in (("turns", turns), ("tokens_per_turn", tokens_per_turn)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__} {key} must be an int >= 1, got {value!r}")
        available = {tool.name: tool for tool in (tools.tools if tools else [])}
        if tool_name not in available:
            raise ValueError(
                f"{type(self).__name__} calls the tool {tool_name!r}, but rollout.multi_turn.tool_config_path loads "
                f"{sorted(available)} (configs/tools/latency_tool.yaml declares it)"
            )
        self.tool = available[tool_name]
        self.turns = turns
        self.tokens_per_turn = tokens_per_turn
        self.response_length = self.rollout_config.response_length

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        if "index" not in kwargs:
            raise ValueError(f"{type(self).__name__} seeds the tool by the prompt's dataset 'index' field; it is missing")
        index = kwargs["index"]
        prompt_index = int(index.item() if hasattr(index, "item") else index)
        messages = list(kwargs["raw_prompt"])
        prompt_ids = await self.ct_build_initial_tokens(messages)
        request_id = uuid4().hex  # one sticky session per trajectory, as verl's ToolAgentLoop
        metrics: dict[str, float] = {}
        response_mask: list[int] = []
        response_logprobs: list[float] = []
        extra_fields: dict[str, Any] = {}
        assistant_turns = tool_turns = 0
        instance_id, _ = await self.tool.create(create_kwargs={"prompt_index": prompt_index})
        try:
            for turn in range(self.turns):
                budget = min(self.tokens_per_turn, self.response_length - len(response_mask))
                if budget <= 0:
                    break
                with simple_timer("generate_sequences", metrics):
                    output = await self.server_manager.generate(
                        request_id=request_id,
                        prompt_ids=prompt_ids,
                        sampling_params={**sampling_params, "max_tokens": budget},
                    )
                # The oldest weights that sampled a token (first turn) and the newest (last turn).
                if not extra_fields:
                    extra_fields.update(output.extra_fields)
                elif output.extra_fields.get("max_global_steps") is not None:
                    extra_fields["max_global_steps"] = output.extra_fields["max_global_steps"]
                assistant_turns += 1
                merged, response_mask, logprobs = await self.ct_merge_assistant_token(
                    prompt_ids,
                    output.token_ids,
                    response_mask,
                    response_logprobs if (response_logprobs or output.log_probs) else None,
                    assistant_logprobs=output.log_probs or None,
                )
                prompt_ids, response_logprobs = merged.token_ids, logprobs or []
                messages.append({"role": "assistant", "content": self.tokenizer.decode(output.token_ids)})
                if turn == self.turns - 1:
                    break
                with simple_timer("tool_calls", metrics):
                    answer, _, _ = await self.tool.execute(instance_id, {"turn": turn})
                previous = list(messages)
                messages.append({"role": "tool", "content": answer.text})
                merged, mask, logprobs = await self.ct_merge_context_msg(
                    previous, messages, prompt_ids, response_mask, response_logprobs or None
                )
                if len(mask) >= self.response_length:
                    break  # no room left to answer the tool: end here, as verl's ToolAgentLoop does
                tool_turns += 1
                prompt_ids, response_mask, response_logprobs = merged.token_ids, mask, logprobs or []
        finally:
            await self.tool.release(instance_id)

        n_response = len(response_mask)
        prompt_part = prompt_ids[: len(prompt_ids) - n_response]
        return AgentLoopOutput(
            prompt_ids=prompt_part,
            response_ids=prompt_ids[len(prompt_part) :][: self.response_length],
            response_mask=response_mask[: self.response_length],
            response_logprobs=response_logprobs[: self.response_length] if response_logprobs else None,
            num_turns=1 + assistant_turns + tool_turns,
            metrics=metrics,
            extra_fields={**extra_fields, "turn_scores": [], "tool_rewards": []},
        )


__all__ = ["LatencyTool", "ToolLatencyAgentLoop", "parse_tool_config", "tool_answer", "tool_latency_s"]
