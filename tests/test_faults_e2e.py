"""A rollout server killed mid-step stops the run with a clear error within a bound: no hang, no short batch.

The CPU rollout server is a Ray actor (``ray::CPUServer``, verl_adapter/cpu_rollout.py) under the
driver's process tree; the test SIGKILLs it right after step 1 is logged, while step 2 generates.
verl's own mechanisms do not restart a rollout replica (its actor has no max_restarts and the agent
loop does not re-resolve servers), so the run must stop: sync, at verl's next call on the dead actor
or at the learner's full-batch check; async, at verl's abort or the sampler's max_rollout_failures.
"""

import subprocess
import time

import psutil
import pytest

from verl_run import REPO, kill_session, read_file_logger, trainer_command, trainer_env

pytestmark = pytest.mark.e2e

STEPS = 6
KILL_BOUND_S = 120  # from the kill to the driver's exit
CLEAR_ERRORS = ("ActorDiedError", "ShortBatchError", "RolloutFailuresError")


def rollout_servers(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True) if "CPUServer" in " ".join(p.cmdline())]


@pytest.mark.parametrize("config_name", ["cpu_tiny", "cpu_tiny_async"])
def test_killed_rollout_server_stops_the_run_with_a_clear_error_in_bounded_time(tmp_path, config_name):
    metrics_path = tmp_path / "metrics.jsonl"
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            trainer_command(config_name, f"trainer.total_training_steps={STEPS}", f"hydra.run.dir={tmp_path / 'hydra'}"),
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
                returncode = process.wait(timeout=KILL_BOUND_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the run hung: still running {KILL_BOUND_S}s after its rollout server was killed")
            exit_s = time.monotonic() - killed
        finally:
            kill_session(process)  # whatever of our own Ray processes survived

    text = log_path.read_text()
    assert returncode != 0, "the run finished as if nothing happened"
    assert any(error in text for error in CLEAR_ERRORS), text[-4000:]
    steps = read_file_logger(metrics_path)
    assert max(steps) < STEPS, f"the run went on training without its rollout server: steps {sorted(steps)}"
    assert exit_s < KILL_BOUND_S, f"the run stopped {exit_s:.1f}s after the kill"
