"""End to end, in verl's real trainer on CPU: what the FlashREINFORCE loss sees of the behaviour policy.

1. The gate and the ratio use the rollout engine's RECORDED sampling log-probs, not verl's recompute.
   Two one-step runs on the same first batch (``data.shuffle=false``: dataset indices 0-31), both with
   the test agent loop of tests/support/perturbing_agent_loop.py. In the control run it changes
   nothing. In the perturbed run it rewrites, after sampling, the recorded log-probs of the trajectory
   with dataset index 0 to the far end of [0, 1], and lowers those of index 1 by 1e-3. Tokens, rewards
   and the policy are the same in both runs (asserted); only the record differs. verl's recompute,
   and so any "old" log-prob it derives, is the same in both runs, so a gate reading the recompute
   would admit every row in both. Observed: the control admits every row, the perturbed run rejects
   exactly the one trajectory (acceptance 31/32), and the small shift shows up in the ratio deviation.

2. The entropy filter runs inside verl. Both runs use ``negative_token_fraction=0.5`` with
   ``failure_reward_threshold=1.0``, so every trajectory counts as failed (rewards lie in [0, 1]) and
   keeps only the higher-entropy half of its tokens: the control run, where the gate admits every
   row, reports a retained-token fraction below 1 and a failed fraction of 1.

The two runs share module-scoped fixtures so each runs once (about 1.5 minutes each on 2 CPU cores).
"""

import json
import os
from pathlib import Path

import pytest

from verl_run import run_trainer

pytestmark = pytest.mark.e2e

SUPPORT = Path(__file__).resolve().parent / "support"
PERTURB_ENV_VAR = "TOP_TEST_PERTURB_ROLLOUT_LOG_PROBS"  # perturbing_agent_loop.PERTURB_ENV_VAR (not importable here)
FAR_INDEX, SHIFTED_INDEX, SHIFT = 0, 1, 1e-3
BATCH_SIZE = 32  # configs/cpu_tiny.yaml data.train_batch_size
PREFIX = "actor/flashreinforce/"

OVERRIDES = (
    "trainer.total_training_steps=1",
    "data.shuffle=false",
    f"actor_rollout_ref.rollout.agent.agent_loop_config_path={SUPPORT / 'perturbing_agent_loop.yaml'}",
    "actor_rollout_ref.rollout.agent.default_agent_loop=perturbing_agent",
    "true_on_policy.negative_token_fraction=0.5",
    "true_on_policy.failure_reward_threshold=1.0",
)


def run_one_step(plan: dict) -> dict[str, float]:
    with pytest.MonkeyPatch.context() as patch:
        # Ray workers of the local cluster inherit the driver's environment: the agent-loop workers
        # import the test loop from here and read the plan.
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")])))
        patch.setenv(PERTURB_ENV_VAR, json.dumps(plan))
        _, steps = run_trainer("cpu_tiny", *OVERRIDES)
    assert sorted(steps) == [1], sorted(steps)
    return steps[1]


@pytest.fixture(scope="module")
def control():
    return run_one_step({})


@pytest.fixture(scope="module")
def perturbed():
    return run_one_step({"steps": [1], "far": [FAR_INDEX], "shift": {str(SHIFTED_INDEX): SHIFT}})


def test_the_gate_and_the_ratio_read_the_recorded_log_probs(control, perturbed):
    # the same trajectories in both runs (the CPU engine seeds each request from its prompt): only their
    # recorded log-probs differ. Batch-mean metrics may differ in the last bits, because the order in
    # which trajectories reach the batch (agent-loop completion order) changes the summation order.
    assert perturbed["response_length/mean"] == control["response_length/mean"]
    for key in ("critic/score/mean", "critic/score/max", "critic/score/min", "actor/entropy"):
        assert perturbed[key] == pytest.approx(control[key], rel=1e-6, abs=1e-9), key

    # control: recorded == recomputed bitwise, every trajectory admitted, ratio exactly 1
    assert control["training/rollout_probs_diff_max"] == 0.0
    assert control[PREFIX + "acceptance_rate"] == 1.0
    assert control[PREFIX + "ratio_deviation_mean"] == 0.0

    # perturbed: verl's own monitor (|p_recorded - p_recomputed|) sees the tampered record: pushing a
    # probability to the far end of [0, 1] moves it by at least 1/2 ...
    assert perturbed["training/rollout_probs_diff_max"] > 0.49
    # ... and the gate rejects exactly the far-perturbed trajectory: one row of 32 (verl averages the
    # per-micro-batch rates of two equal micro-batches of 16, which is again 31/32)
    assert perturbed[PREFIX + "acceptance_rate"] < 1.0
    assert perturbed[PREFIX + "acceptance_rate"] == pytest.approx(1 - 1 / BATCH_SIZE, abs=1e-9)
    assert perturbed[PREFIX + "sequence_kl_mean"] > control[PREFIX + "sequence_kl_mean"]
    # the admitted, slightly shifted trajectory: ratio exp(1e-3) on its tokens, 1 elsewhere
    assert 0.0 < perturbed[PREFIX + "ratio_deviation_mean"] < 2 * SHIFT
    # the far-perturbed row's tokens are gone from the retained ones too
    assert perturbed[PREFIX + "retained_token_fraction"] < control[PREFIX + "retained_token_fraction"]


def test_the_entropy_filter_runs_inside_verl(control):
    assert control[PREFIX + "failed_fraction"] == 1.0  # threshold 1.0: every trajectory failed
    assert control[PREFIX + "acceptance_rate"] == 1.0  # so every dropped token is the filter's doing
    # each row keeps ceil(T_i / 2) of its T_i tokens: at least half, and fewer than all once T_i >= 2
    assert 0.5 <= control[PREFIX + "retained_token_fraction"] < 1.0
