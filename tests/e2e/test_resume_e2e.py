"""Resume through verl's own checkpointing is bitwise; a SIGTERM leaves the last checkpoint usable.

Each test runs verl's real trainer (``python -m verl.trainer.main_ppo``) and reads verl's file-logger
JSONL. Every metric must match except wall-clock timings and memory/throughput readings. The
uninterrupted 6-step runs (checkpoints at 3 and 6) are the suite's shared ones (tests/support/verl_run.py).
"""

import signal
import subprocess
import time

import pytest
import torch

from true_on_policy.cli.plot_metrics import read_step_metrics
from true_on_policy.verl_adapter.trainer_hooks import MISMATCHED_TOKENS_METRIC
from verl_run import (
    CPU_TINY,
    CPU_TINY_FLAG_OFF,
    CPU_TINY_FLAG_OFF_RESUMED,
    CPU_TINY_MOE,
    CPU_TINY_MOE_RESUMED,
    REPO,
    SAVE_EVERY,
    STEPS,
    Run,
    actor_weights,
    differing,
    kill_session,
    latest_checkpoint,
    learned,
    run_logged,
    train_steps,
    trainer_command,
    trainer_env,
)

pytestmark = pytest.mark.e2e

STOP_AT = SAVE_EVERY
SIGTERM_BOUND_S = 60  # driver gone and processes reaped within this after SIGTERM (measured: 4.5 s)
HUNG_S = 600  # no exit by then: the driver hangs (a wait this long keeps the bound above reachable)


def checkpointing(directory):
    """The shared runs' step and checkpoint settings, with the checkpoints in ``directory``."""
    return (*CPU_TINY.overrides, f"trainer.default_local_dir={directory}", f"hydra.run.dir={directory}_hydra")


def sigterm_after_checkpoint(config_name, metrics_path, checkpoint_dir, step, *overrides, timeout=600):
    """Start a run, SIGTERM the driver once verl's tracker names ``step``; returns seconds to exit.

    The driver runs in its own session, so whatever it leaves behind is found by its process group
    and killed (only our own processes).
    """
    command = trainer_command(config_name, *overrides)
    log = open(metrics_path.with_suffix(".log"), "w")
    process = subprocess.Popen(
        command, cwd=REPO, env=trainer_env(metrics_path), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + timeout
        while latest_checkpoint(checkpoint_dir) != step:
            assert process.poll() is None, f"the run exited ({process.returncode}) before checkpoint {step}"
            assert time.monotonic() < deadline, f"no checkpoint {step} within {timeout}s"
            time.sleep(0.1)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=HUNG_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the driver hung: still running {HUNG_S}s after SIGTERM")
        exit_s = time.monotonic() - sent
        print(f"driver exited {exit_s:.1f}s after SIGTERM")
        return exit_s
    finally:
        kill_session(process)  # Ray's processes the driver started, if any survived
        log.close()


@pytest.fixture(scope="module")
def stopped_and_resumed(tmp_path_factory):
    """cpu_tiny: 3 steps, SIGTERM once checkpoint 3 is written, then resumed (trainer.resume_mode=auto)
    to step 6. Steps 1-3 are a second launch of the shared CPU_TINY configuration (same seed)."""
    folder = tmp_path_factory.mktemp("sigterm")
    exit_s = sigterm_after_checkpoint("cpu_tiny", folder / "stopped.jsonl", folder / "stopped", STOP_AT,
                                      *checkpointing(folder / "stopped"))
    tracker = latest_checkpoint(folder / "stopped")
    stopped = read_step_metrics(folder / "stopped.jsonl")
    run_logged("cpu_tiny", folder / "resumed.jsonl", *checkpointing(folder / "stopped"), "trainer.resume_mode=auto")
    return exit_s, tracker, stopped, read_step_metrics(folder / "resumed.jsonl"), folder / "stopped"


def test_sigterm_then_resume_matches_an_uninterrupted_run_bitwise(verl_runs, stopped_and_resumed):
    """cpu_tiny: 6 steps vs 3 steps, SIGTERM, resume (trainer.resume_mode=auto), 3 more steps."""
    uninterrupted = verl_runs(CPU_TINY)
    full = uninterrupted.metrics
    exit_s, tracker, stopped, resumed, checkpoints = stopped_and_resumed
    assert exit_s < SIGTERM_BOUND_S, f"the driver exited {exit_s:.1f}s after SIGTERM"
    # The last completed checkpoint is what the tracker names, complete (a later save never became latest).
    assert tracker == STOP_AT
    assert not differing(full, stopped, range(1, STOP_AT + 1))

    assert sorted(resumed) == list(range(STOP_AT + 1, STEPS + 1)), "the resumed run did not start at step 4"
    assert not differing(full, resumed, resumed)
    assert learned(full, resumed), "the compared steps learned nothing"

    final, final_resumed = actor_weights(uninterrupted.checkpoint(STEPS)), actor_weights(checkpoints / f"global_step_{STEPS}")
    assert final.keys() == final_resumed.keys()
    assert all(torch.equal(final[name], final_resumed[name]) for name in final)


def test_same_seed_same_metrics_bitwise(verl_runs, stopped_and_resumed):
    """Two launches of cpu_tiny with the same seed -- the shared CPU_TINY and the SIGTERM test's run up to
    its stop (steps 1-3) -- are bitwise equal in every reproducible metric."""
    first = verl_runs(CPU_TINY).metrics
    _, _, second, _, _ = stopped_and_resumed
    assert sorted(first) == list(range(1, STEPS + 1))
    assert sorted(second)[:STOP_AT] == list(range(1, STOP_AT + 1))
    # every reproducible metric, bit for bit; a NaN (verl's JSON null) only matches a NaN
    assert not differing(first, second, range(1, STOP_AT + 1))
    # The runs learned something comparable: the loss is a finite non-zero number at least once.
    assert learned(first, range(1, STOP_AT + 1))


def full_and_resumed(verl_runs, run, resumed_run):
    """An uninterrupted run, and the run resumed from its step-3 checkpoint (resume_path)."""
    full, resumed = verl_runs(run), verl_runs(resumed_run)
    assert sorted(resumed.metrics) == list(range(STOP_AT + 1, STEPS + 1))
    return full, resumed


def test_moe_resume_is_bitwise(verl_runs):
    full, resumed = full_and_resumed(verl_runs, CPU_TINY_MOE, CPU_TINY_MOE_RESUMED)
    assert not differing(full.metrics, resumed.metrics, resumed.metrics)
    assert learned(full.metrics, resumed.metrics), "the compared steps learned nothing"
    final, final_resumed = actor_weights(full.checkpoint(STEPS)), actor_weights(resumed.checkpoint(STEPS))
    assert final.keys() == final_resumed.keys()
    assert all(torch.equal(final[name], final_resumed[name]) for name in final)


ASYNC_PROMPTS = 16  # data.train_max_samples: 2 learner steps of 8 per epoch
ASYNC_FIRST = Run("cpu_tiny_async", train_steps(STOP_AT, SAVE_EVERY) + (f"data.train_max_samples={ASYNC_PROMPTS}",))
ASYNC_RESUMED = Run(
    "cpu_tiny_async", train_steps(STEPS, SAVE_EVERY) + (f"data.train_max_samples={ASYNC_PROMPTS}",),
    resume_from=(ASYNC_FIRST, STOP_AT),
)


def test_async_exactly_once_per_epoch_across_a_resume(verl_runs):
    """cpu_tiny_async: 3 steps, stop, resume to 6 steps: 3 epochs of 16 prompts, each prompt once per epoch."""
    import pickle

    from true_on_policy.verl_adapter.resume import SAMPLER_STATE_FILE

    first, resumed = verl_runs(ASYNC_FIRST).metrics, verl_runs(ASYNC_RESUMED)
    assert sorted(first) == [1, 2, 3] and sorted(resumed.metrics) == [4, 5, 6]

    state = torch.load(resumed.checkpoint(STEPS) / SAMPLER_STATE_FILE, weights_only=False)
    ledger = pickle.loads(state["ledger"])
    ledger.check_invariants()
    log = ledger.delivery_log  # (epoch, prompt_id, learner_step, attempt_id), both processes
    assert [step for _, _, step, _ in log] == sorted(step for _, _, step, _ in log)
    assert sorted({step for _, _, step, _ in log}) == list(range(1, STEPS + 1))
    assert len(log) == STEPS * 8
    per_epoch = {}
    for epoch, prompt_id, _, _ in log:
        per_epoch.setdefault(epoch, []).append(prompt_id)
    for epoch, prompts in per_epoch.items():
        assert len(prompts) == len(set(prompts)), f"epoch {epoch}: a prompt reached the learner twice"
    # 48 deliveries of 16 prompts: epochs 0 and 1 complete, across the resume at step 3.
    assert len(per_epoch[0]) == len(per_epoch[1]) == ASYNC_PROMPTS
    assert sum(map(len, per_epoch.values())) == STEPS * 8
    # The sampler's own per-step view (file logger) agrees with the ledger: 8 trajectories per step, and
    # as many distinct prompts as the ledger delivered then -- 8, or 7 when a batch that spans an epoch
    # boundary holds one prompt from both epochs (async dispatch runs ahead into the next epoch).
    for step, metrics in {**first, **resumed.metrics}.items():
        delivered = [prompt_id for _, prompt_id, s, _ in log if s == step]
        assert len(delivered) == 8
        assert metrics["flashreinforce/sampler/distinct_prompts"] == len(set(delivered))


def test_flag_off_twin_shows_where_determinism_ends(verl_runs):
    """true_on_policy.deterministic=false: the same resume, without the consistent kernels and canonical order.

    Observed: steps 4-6 differ: at step 4 the same tokens are sampled but the rollout's recorded
    log-probs and the batch-order-dependent reductions differ in their last bits (the default
    kernels' results depend on which requests share the rollout's running batch, which depends on
    arrival timing; the batch is not sorted), so verl's rollout_probs_diff_*/ppl and the trust-region
    KL differ; by step 6 the sampled tokens, rewards and loss differ, and the final weights are not equal.
    """
    full, resumed = (result.metrics for result in full_and_resumed(verl_runs, CPU_TINY_FLAG_OFF, CPU_TINY_FLAG_OFF_RESUMED))
    assert differing(full, resumed, resumed), "without the flag the resumed run matched bitwise: the twin shows nothing"
    # The training/rollout gap is non-zero without the flag: the proof of zero logdiff is the flag's.
    assert all(full[s]["training/rollout_probs_diff_max"] > 0 for s in resumed)
    assert all(full[s][MISMATCHED_TOKENS_METRIC] >= 1 for s in resumed)  # the recipe's per-token count agrees
