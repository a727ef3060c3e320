"""A test agent loop: verl's single-turn loop, then it tampers with the RECORDED sampling log-probs.

Used by tests/e2e/test_behaviour_log_probs_e2e.py to show that FlashREINFORCE's gate and ratio read the
rollout engine's recorded log-probs (``rollout_log_probs`` -> ``old_log_probs``), not a recompute: the
tokens, the rewards and the policy are untouched, only the record of how probable each sampled token
was changes, and with it the gate's decision.

verl's agent-loop workers (Ray actors) build it through hydra from the file that
``actor_rollout_ref.rollout.agent.agent_loop_config_path`` names (``perturbing_agent_loop.yaml``,
next to this module), with ``default_agent_loop=perturbing_agent``. The module must be importable
there: the test puts this folder on PYTHONPATH, which the local Ray cluster's workers inherit.

What to perturb comes from the environment variable ``PERTURB_ENV_VAR``, a JSON object:

    {"steps": [1], "far": [0], "shift": {"1": 1e-3}}

* ``steps``: the global steps (``global_steps``, from 1) whose trajectories are perturbed;
* ``far``: dataset indices (``extra_info.index``) whose recorded probabilities are pushed to the far
  end of [0, 1]: p < 0.5 becomes p = 1 (log-prob 0), p >= 0.5 becomes p * exp(-20). Every token's
  Bernoulli KL against the true probability is then >= ln 2, far above any sane gate threshold;
* ``shift``: dataset index -> eps; the recorded log-probs are lowered by eps, a small change the
  gate admits but the importance ratio exp(current - recorded) = exp(eps) shows.

Unset or empty: the loop is verl's single-turn loop unchanged. It is also
:class:`fail_first_rollouts_agent_loop.FailFirstRolloutsAgentLoop` (its ``FAIL_ENV_VAR`` unset: no
failure), so tests/e2e/test_faults_e2e.py's failed-rollout run is this test's control run plus one failure,
and the control run is its twin.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from fail_first_rollouts_agent_loop import FailFirstRolloutsAgentLoop
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

PERTURB_ENV_VAR = "TOP_TEST_PERTURB_ROLLOUT_LOG_PROBS"
FAR_SHIFT = 20.0


def perturbation_plan() -> dict[str, Any]:
    text = os.environ.get(PERTURB_ENV_VAR, "")
    plan = json.loads(text) if text else {}
    return {
        "steps": {int(step) for step in plan.get("steps", ())},
        "far": {int(index) for index in plan.get("far", ())},
        "shift": {int(index): float(eps) for index, eps in plan.get("shift", {}).items()},
    }


def push_far(log_probs: list[float]) -> list[float]:
    return [0.0 if value < math.log(0.5) else value - FAR_SHIFT for value in log_probs]


def shift(log_probs: list[float], eps: float) -> list[float]:
    return [value - eps for value in log_probs]


def _as_int(value: Any) -> int:
    return int(value.item()) if hasattr(value, "item") else int(value)


class PerturbingAgentLoop(FailFirstRolloutsAgentLoop):
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        output = await super().run(sampling_params, **kwargs)
        plan = perturbation_plan()
        if not plan["steps"] or output.response_logprobs is None:
            return output
        step, index = _as_int(kwargs.get("global_steps", -1)), _as_int(kwargs.get("index", -1))
        if step not in plan["steps"]:
            return output
        if index in plan["far"]:
            output.response_logprobs = push_far(output.response_logprobs)
        elif index in plan["shift"]:
            output.response_logprobs = shift(output.response_logprobs, plan["shift"][index])
        return output
