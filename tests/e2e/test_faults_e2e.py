"""A rollout server killed mid-step stops the run with a clear error within a bound: no hang, no short batch.

The CPU rollout server is a Ray actor (``ray::CPUServer``, verl_adapter/cpu_rollout.py) under the
driver's process tree; the test SIGKILLs it right after step 1 is logged, while step 2 generates.
verl's own mechanisms do not restart a rollout replica (its actor has no max_restarts and the agent
loop does not re-resolve servers), so the run must stop: sync, at verl's next call on the dead actor
or at the learner's full-batch check; async, at verl's abort or the sampler's max_rollout_failures.
Measured (docs/journal.md): both stop at verl's next call on the dead actor (``ActorDiedError``
naming ``CPUServer``), 11.7 s and 13.5 s after the kill; the twin is the same shared run unkilled,
which trains every step.

The project's own guard on that path -- the learner refuses a batch short of prompts
(``ShortBatchError``) where verl 0.9.1 would pad the failed groups and train on them -- is shown with
a sync run whose first rollout fails (tests/support/fail_first_rollouts_agent_loop.py, through the
behaviour test's agent loop), and its twin: the same run with no failure (the behaviour test's control
run) trains. (Measured 2026-12-05: with verl's
``++trainer.v1.sampler.sync_refill_failed_groups=true`` the batch was still short -- 31 of 32
prompts -- and the run stopped with the same error; the error names the async sampler instead, whose
re-queue of a failed prompt tests/e2e/test_async_sampler_e2e.py shows.)
"""

import dataclasses
import subprocess
import time

import psutil
import pytest

from true_on_policy.verl_adapter.trainer_hooks import MISMATCHED_TOKENS_METRIC

from test_behaviour_log_probs_e2e import CONTROL
from verl_run import CPU_TINY, CPU_TINY_ASYNC, REPO, kill_session, read_file_logger, trainer_command, trainer_env

pytestmark = pytest.mark.e2e

FAIL_ENV_VAR = "TOP_TEST_FAIL_FIRST_ROLLOUTS"  # fail_first_rollouts_agent_loop.FAIL_ENV_VAR (not importable here)
KILL_BOUND_S = 120  # from the kill to the driver's exit (measured: 11.7 s sync, 13.5 s async)
HUNG_S = 600  # no exit by then: the run hangs (a wait this long keeps the bound above reachable)
# The killed server's run stops at verl's call on the dead actor, or at one of the project's guards.
CLEAR_ERRORS = ("ActorDiedError: The actor died", "ShortBatchError", "RolloutFailuresError")
KILLED_RUNS = {"cpu_tiny": CPU_TINY, "cpu_tiny_async": CPU_TINY_ASYNC}  # killed, and unkilled (the twin)


def rollout_servers(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True) if "CPUServer" in " ".join(p.cmdline())]


@pytest.mark.parametrize("config_name", sorted(KILLED_RUNS))
def test_killed_rollout_server_stops_the_run_with_a_clear_error_in_bounded_time(tmp_path, config_name):
    run = KILLED_RUNS[config_name]
    steps_total = int(run.overrides[0].split("=")[1])
    metrics_path = tmp_path / "metrics.jsonl"
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            trainer_command(config_name, *run.overrides, f"trainer.default_local_dir={tmp_path / 'checkpoints'}",
                            f"hydra.run.dir={tmp_path / 'hydra'}"),
            cwd=REPO,
            env=trainer_env(metrics_path),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 600
            while not (metrics_path.exists() and metrics_path.read_text().strip()):
                assert process.poll() is None, f"the run exited ({process.returncode}) before step 1"
                assert time.monotonic() < deadline, "no step 1 within 600 s"
                time.sleep(0.05)
            servers = rollout_servers(process.pid)
            assert len(servers) == 1, f"expected one CPU rollout server, found {servers}"
            servers[0].kill()
            killed = time.monotonic()
            try:
                returncode = process.wait(timeout=HUNG_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the run hung: still running {HUNG_S}s after its rollout server was killed")
            exit_s = time.monotonic() - killed
            print(f"the run exited {exit_s:.1f}s after its rollout server was killed")
        finally:
            kill_session(process)  # whatever of our own Ray processes survived

    text = log_path.read_text()
    assert returncode != 0, "the run finished as if nothing happened"
    assert any(error in text for error in CLEAR_ERRORS), text[-4000:]
    assert "ShortBatchError" in text or "RolloutFailuresError" in text or "CPUServer" in text, text[-4000:]
    steps = read_file_logger(metrics_path)
    assert max(steps) < steps_total, f"the run went on training without its rollout server: steps {sorted(steps)}"
    assert exit_s < KILL_BOUND_S, f"the run stopped {exit_s:.1f}s after the kill"


@pytest.mark.parametrize("config_name", sorted(KILLED_RUNS))
def test_twin_the_same_run_unkilled_trains_every_step(verl_runs, config_name):
    run = KILLED_RUNS[config_name]
    steps_total = int(run.overrides[0].split("=")[1])
    assert sorted(verl_runs(run).metrics) == list(range(1, steps_total + 1))


# The failed-rollout run is the behaviour test's control run (cpu_tiny, 1 step, its test agent loop, which
# also fails the first N prompts it sees) with one failure; the control run itself is the twin.
FAILED_ROLLOUT = dataclasses.replace(CONTROL, env=CONTROL.env + ((FAIL_ENV_VAR, "1"),))


def test_a_sync_batch_short_of_a_failed_prompt_stops_the_run_with_short_batch_error(verl_runs):
    """verl 0.9.1 (sync_refill_failed_groups=false) pads the failed group; the learner refuses it by name."""
    with pytest.raises(AssertionError, match="failed") as failure:
        verl_runs(FAILED_ROLLOUT)
    text = str(failure.value)
    assert "ShortBatchError" in text and "31 prompts, expected 32" in text and "1 rollout(s) failed" in text, text[-4000:]


def test_twin_the_same_run_without_a_failed_rollout_trains(verl_runs):
    """The same launch without the failure (the behaviour test's control run): a full batch, trained at logdiff 0."""
    metrics = verl_runs(CONTROL).metrics
    assert sorted(metrics) == [1]
    assert metrics[1]["training/rollout_probs_diff_max"] == 0.0 and metrics[1][MISMATCHED_TOKENS_METRIC] == 0.0
