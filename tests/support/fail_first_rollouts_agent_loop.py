"""A test agent loop: verl's single-turn loop, except that the first N distinct prompts it sees raise once each.

Used by tests/e2e/test_async_sampler_e2e.py (and, through perturbing_agent_loop.py, by
tests/e2e/test_faults_e2e.py): the exception is what a crashed tool or a dead server connection produces;
verl's agent_loop_tq marks the prompt ``failure`` with no trajectory, and the single-rollout sampler
must re-queue it (the sync learner refuses the short batch). N comes from the environment variable
``FAIL_ENV_VAR``.

verl's agent-loop worker (a Ray actor; num_workers=1 in cpu_tiny, so one process keeps the count)
builds it through hydra from ``fail_first_rollouts_agent_loop.yaml`` (next to this module), with
``default_agent_loop=fail_first_rollouts``; the test puts this folder on PYTHONPATH, which the local
Ray cluster's workers inherit.
"""

from __future__ import annotations

import os

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

FAIL_ENV_VAR = "TOP_TEST_FAIL_FIRST_ROLLOUTS"


class FailFirstRolloutsAgentLoop(SingleTurnAgentLoop):
    failed_indices: set[int] = set()

    async def run(self, sampling_params, **kwargs):
        index = int(getattr(kwargs["index"], "item", lambda: kwargs["index"])())
        budget = int(os.environ.get(FAIL_ENV_VAR, "0"))
        if index not in self.failed_indices and len(self.failed_indices) < budget:
            FailFirstRolloutsAgentLoop.failed_indices.add(index)
            raise RuntimeError(f"injected rollout failure for prompt index {index}")
        return await super().run(sampling_params, **kwargs)
