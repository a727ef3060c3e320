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

Both runs are shared runs (tests/support/verl_run.py): each launches once for the two tests.
"""

import json
from pathlib import Path

import pytest

from true_on_policy.verl_adapter.trainer_hooks import MISMATCHED_TOKENS_METRIC

from verl_run import Run, same_bits

pytestmark = pytest.mark.e2e

SUPPORT = Path(__file__).resolve().parents[1] / "support"
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


def one_step(plan: dict) -> Run:
    """Ray workers of the local cluster inherit the driver's environment: the agent-loop workers
    import the test loop from tests/support and read the plan."""
    return Run("cpu_tiny", OVERRIDES, env=((PERTURB_ENV_VAR, json.dumps(plan)),), pythonpath=(str(SUPPORT),))


CONTROL = one_step({})
PERTURBED = one_step({"steps": [1], "far": [FAR_INDEX], "shift": {str(SHIFTED_INDEX): SHIFT}})


@pytest.fixture
def control(verl_runs):
    metrics = verl_runs(CONTROL).metrics
    assert sorted(metrics) == [1], sorted(metrics)
    return metrics[1]


@pytest.fixture
def perturbed(verl_runs):
    metrics = verl_runs(PERTURBED).metrics
    assert sorted(metrics) == [1], sorted(metrics)
    return metrics[1]


def test_the_gate_and_the_ratio_read_the_recorded_log_probs(control, perturbed):
    # the same trajectories in both runs (the CPU engine seeds each request from its prompt): only their
    # recorded log-probs differ. The batch is in the canonical order (sorted by token sequence) before
    # verl reduces it, whatever order the agent loops completed in, so the batch metrics of the same
    # trajectories under the same weights are the same bits.
    for key in ("response_length/mean", "critic/score/mean", "critic/score/max", "critic/score/min", "actor/entropy"):
        assert same_bits(perturbed[key], control[key]), (key, perturbed[key], control[key])

    # control: recorded == recomputed bitwise, every trajectory admitted, ratio exactly 1
    assert control["training/rollout_probs_diff_max"] == 0.0 and control[MISMATCHED_TOKENS_METRIC] == 0.0
    assert control[PREFIX + "acceptance_rate"] == 1.0
    assert control[PREFIX + "ratio_deviation_mean"] == 0.0

    # perturbed: verl's own monitor (|p_recorded - p_recomputed|) sees the tampered record: pushing a
    # probability to the far end of [0, 1] moves it by at least 1/2 ...
    assert perturbed["training/rollout_probs_diff_max"] > 0.49
    assert perturbed[MISMATCHED_TOKENS_METRIC] >= 2  # every token of the two rewritten records, at least one each
    # ... and the gate rejects exactly the far-perturbed trajectory: one row of 32 (verl averages the
    # per-micro-batch rates of two equal micro-batches of 16, which is again 31/32)
    assert perturbed[PREFIX + "acceptance_rate"] < 1.0
    assert perturbed[PREFIX + "acceptance_rate"] == 1 - 1 / BATCH_SIZE  # 31/32, exact in binary
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
