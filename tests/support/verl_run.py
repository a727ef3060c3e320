"""verl's real trainer (``python -m verl.trainer.main_ppo``) in a subprocess: its metrics, and one launch
per distinct run shared by every test that reads it.

Metrics come from verl's file logger (``trainer.logger=[console,file]``, verl/utils/tracking.py
``FileLogger``): one JSON object per ``Tracking.log`` call, ``{"step": N, "data": {metric: value}}``,
written to ``$VERL_FILE_LOGGER_PATH``, read by :func:`read_step_metrics` (a JSON null, which is how
verl writes a NaN, reads as NaN; compare metrics with :func:`same_bits` / :func:`differing`, which
count NaN as equal to NaN only). Console text is kept for failure messages.

Shared runs -- the suite's one place for verl launches
------------------------------------------------------
A :class:`Run` is one launch: config, overrides, extra environment, files it reads, and optionally
the run whose checkpoint it resumes from. A test takes the session fixture ``verl_runs``
(tests/conftest.py) and calls it: ``result = verl_runs(CPU_TINY)``. The first call launches the run
to completion; every later call -- from any test, any file, any pytest-xdist worker of the session
-- returns the same :class:`RunResult` (``metrics``, ``log``, ``directory``, ``checkpoint(step)``).
Equal Runs are one run, so two files that declare the same Run share it. A launch that failed
fails every test that reads it with the same message, without launching again. Every shared launch
writes its checkpoints and Hydra output under its own folder (never the repository's).

The runs several tests read are declared below (``CPU_TINY`` ...); a test declares its own as
``verl_runs(Run(config, overrides))`` (a run of more steps serves a test that reads the first few). A
test that needs its own process (a SIGTERM, a killed server, a launch expected to fail) uses
:func:`trainer_command` / :func:`trainer_env`; :func:`run_logged` launches an unshared run.

Host memory: a verl launch with a vLLM rollout takes about 8 GiB (Ray, two training ranks, vLLM's
processes), so two fit this 24 GiB host and three do not. Such launches share the host
(:func:`vllm_launch_share`, a shared file lock); a test that runs two at once itself takes the host
whole (:func:`whole_host`), so no third starts beside them. (Two at once are otherwise safe: each
names its own weight-sync socket, verl_adapter/patches.py ``launch_socket``.)
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from true_on_policy.cli.plot_metrics import read_step_metrics

import other_checkpoints  # tests/: the checkpoints a Run may launch on

REPO = Path(__file__).resolve().parents[2]
FILE_LOGGER_PATH_ENV = "VERL_FILE_LOGGER_PATH"  # read by verl.utils.tracking.FileLogger
LOGGER_OVERRIDE = "trainer.logger=[console,file]"
# Ray's dashboard is a dozen processes at every launch that no test reads: off in test launches.
NO_DASHBOARD_OVERRIDE = "++ray_kwargs.ray_init.include_dashboard=false"

# Wall-clock and host-memory readings differ between any two runs; everything else must not.
NOT_REPRODUCIBLE = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/")


# ---------------------------------------------------------------- shared runs
@dataclasses.dataclass(frozen=True)
class Run:
    """One verl launch. ``overrides`` may name ``{run_dir}``, the run's own folder; ``files`` are
    ``(name, text)`` written there before the launch; ``checkpoint`` names a factory of
    tests/support/other_checkpoints.py: the launch writes that checkpoint into the run's folder first and runs
    on it (``actor_rollout_ref.model.path``); ``pythonpath`` entries are prepended to the
    launch's PYTHONPATH (Ray workers inherit it: a test agent loop imports from there); ``env`` adds
    variables; ``resume_from`` is ``(run, step)``: resume from that run's step checkpoint; ``copy``
    tells apart two launches of the same configuration (run-to-run reproducibility)."""

    config: str
    overrides: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    pythonpath: tuple[str, ...] = ()
    files: tuple[tuple[str, str], ...] = ()
    checkpoint: str | None = None
    resume_from: tuple[Run, int] | None = None
    copy: int = 0
    timeout: int = 900

    @property
    def name(self) -> str:
        """A folder name: the config and a digest of everything that makes the launch."""
        return f"{self.config}-{hashlib.sha1(repr(self).encode()).hexdigest()[:12]}"


@dataclasses.dataclass(frozen=True)
class RunResult:
    run: Run
    directory: Path
    metrics: dict[int, dict[str, float]]

    @property
    def log(self) -> str:
        return (self.directory / CONSOLE).read_text()

    @property
    def checkpoints(self) -> Path:
        return self.directory / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"global_step_{step}"


CONSOLE, METRICS, DONE, FAILED = "console.log", "metrics.jsonl", "DONE", "FAILED"


class SharedRuns:
    """``runs(run) -> RunResult``: launched once under ``root``, shared across processes by a file lock."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def __call__(self, run: Run) -> RunResult:
        base = self(run.resume_from[0]) if run.resume_from else None
        directory = self.root / run.name
        with _locked(self.root / f"{run.name}.lock", fcntl.LOCK_EX):
            if not (directory / DONE).exists() and not (directory / FAILED).exists():
                _launch(run, directory, base)
        if (directory / FAILED).exists():
            raise AssertionError(f"shared run {run.name} failed (once, for every test reading it):\n"
                                 + (directory / FAILED).read_text())
        return RunResult(run, directory, read_step_metrics(directory / METRICS))


@contextmanager
def _locked(path: Path, mode: int):
    with open(path, "a") as handle:
        fcntl.flock(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


HOST_MEMORY_LOCK = Path(tempfile.gettempdir()) / "true_on_policy-vllm-host-memory.lock"
_whole_host_held = threading.Event()  # set while this process holds the host whole (its launches pass)


@contextmanager
def vllm_launch_share(config_name: str):
    """Around a launch: a ``*vllm*`` config holds the host-memory lock shared (see the module doc)."""
    if "vllm" not in config_name or _whole_host_held.is_set():
        yield
        return
    with _locked(HOST_MEMORY_LOCK, fcntl.LOCK_SH):
        yield


@contextmanager
def whole_host():
    """Hold the host-memory lock exclusively: for a test whose own launches are two vLLM runs at once."""
    with _locked(HOST_MEMORY_LOCK, fcntl.LOCK_EX):
        _whole_host_held.set()
        try:
            yield
        finally:
            _whole_host_held.clear()


def _launch(run: Run, directory: Path, base: RunResult | None) -> None:
    shutil.rmtree(directory, ignore_errors=True)  # what a launch cut short (a killed worker) left behind
    directory.mkdir(parents=True)
    for name, text in run.files:
        (directory / name).write_text(text)
    overrides = [override.replace("{run_dir}", str(directory)) for override in run.overrides]
    if run.checkpoint is not None:
        checkpoint = getattr(other_checkpoints, run.checkpoint)(directory / "checkpoint")
        overrides.append(f"actor_rollout_ref.model.path={checkpoint}")
    if base is not None:
        overrides += ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={base.checkpoint(run.resume_from[1])}"]
    overrides += [f"trainer.default_local_dir={directory / 'checkpoints'}", f"hydra.run.dir={directory / 'hydra'}"]
    command = trainer_command(run.config, *overrides)
    env = trainer_env(directory / METRICS)
    env.update(run.env)
    if run.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*run.pythonpath, env.get("PYTHONPATH")]))
    with open(directory / CONSOLE, "w") as console, vllm_launch_share(run.config):
        # its own session: on a timeout the whole tree (Ray's processes too) is killed, only ours
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=console, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=run.timeout)
        except subprocess.TimeoutExpired:
            returncode = f"killed after {run.timeout}s"
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # whatever of the run's own processes is left
            except ProcessLookupError:
                pass
            process.wait()
    problem = None
    if returncode != 0:
        problem = f"trainer exited {returncode}"
    elif not (directory / METRICS).exists():
        problem = "trainer wrote no metrics file"
    if problem:
        tail = (directory / CONSOLE).read_text()[-6000:]
        (directory / FAILED).write_text(f"{problem}; command: {' '.join(command)}\n{tail}")
    else:
        (directory / DONE).write_text("")


def train_steps(n: int, save_every: int | None = None) -> tuple[str, ...]:
    """Overrides for ``n`` training steps, a checkpoint every ``save_every`` (under the run's folder)."""
    return (f"trainer.total_training_steps={n}",) + ((f"trainer.save_freq={save_every}",) if save_every else ())


# The runs several tests read. 6 steps, a checkpoint at 3 and 6: the e2e checks read every step, the
# resume tests resume from step 3 and compare steps 4-6 and the final weights.
STEPS, SAVE_EVERY = 6, 3
FLAG_OFF = "true_on_policy.deterministic=false"
CPU_TINY = Run("cpu_tiny", train_steps(STEPS, SAVE_EVERY))
CPU_TINY_MOE = Run("cpu_tiny_moe", train_steps(STEPS, SAVE_EVERY))
CPU_TINY_MOE_RESUMED = dataclasses.replace(CPU_TINY_MOE, resume_from=(CPU_TINY_MOE, SAVE_EVERY))
CPU_TINY_FLAG_OFF = Run("cpu_tiny", train_steps(STEPS, SAVE_EVERY) + (FLAG_OFF,))
CPU_TINY_FLAG_OFF_RESUMED = dataclasses.replace(CPU_TINY_FLAG_OFF, resume_from=(CPU_TINY_FLAG_OFF, SAVE_EVERY))
CPU_TINY_ASYNC = Run("cpu_tiny_async", train_steps(4))  # the async sampler's checks read 4 steps


# ---------------------------------------------------------------- comparing metrics
def reproducible(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith(NOT_REPRODUCIBLE)}


def same_bits(a: float | None, b: float | None) -> bool:
    """The same float, bit for bit (so 0.0 is not -0.0); NaN (a JSON null) equals NaN and nothing else."""
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return struct.pack("<d", a) == struct.pack("<d", b)


def differing(first: dict, second: dict, step_numbers) -> dict:
    """``{step: {metric: (first, second)}}`` for every reproducible metric that differs or is missing."""
    out = {}
    for step in step_numbers:
        a, b = reproducible(first[step]), reproducible(second[step])
        diff = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if not same_bits(a.get(k), b.get(k))}
        if diff:
            out[step] = diff
    return out


def learned(metrics: dict[int, dict[str, float]], step_numbers) -> bool:
    """Some step's policy loss is a finite non-zero number (a NaN loss is not learning)."""
    return any(math.isfinite(metrics[s]["actor/pg_loss"]) and metrics[s]["actor/pg_loss"] != 0.0 for s in step_numbers)


# ---------------------------------------------------------------- unshared launches
def trainer_command(config_name: str, *overrides: str) -> list[str]:
    """``python -m verl.trainer.main_ppo`` for ``config_name``, run from the repository: Hydra's run
    folder (its ``outputs/``) goes to a fresh temporary folder unless ``overrides`` name one, so that
    no launch writes into the repository."""
    if not any(override.startswith("hydra.run.dir=") for override in overrides):
        overrides = (*overrides, f"hydra.run.dir={tempfile.mkdtemp(prefix='verl_hydra_')}")
    return [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        f"--config-path={REPO / 'configs'}",
        f"--config-name={config_name}",
        LOGGER_OVERRIDE,
        NO_DASHBOARD_OVERRIDE,
        *overrides,
    ]


def kill_session(process: subprocess.Popen) -> None:
    """Kill a run started with ``start_new_session=True``: the driver if it still runs, then whatever
    of its session survived (Ray's processes the driver started; only our own processes)."""
    if process.poll() is None:
        process.kill()
        process.wait()
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def trainer_env(metrics_path: Path) -> dict[str, str]:
    """The environment of a run whose file logger writes to ``metrics_path`` (verl/utils/tracking.py)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1", FILE_LOGGER_PATH_ENV: str(metrics_path)}


def read_file_logger(path: Path) -> dict[int, dict]:
    """``{step: metrics}`` from verl's FileLogger JSONL as written (a null stays None, text stays text)."""
    steps: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(int(record["step"]), {}).update(record["data"])
    return steps


def run_logged(config_name: str, metrics_path: Path, *overrides: str, timeout: int = 900) -> dict[int, dict]:
    """Run the trainer to completion with the file logger at ``metrics_path``; its metrics per step."""
    command = trainer_command(config_name, *overrides)
    with vllm_launch_share(config_name):
        result = subprocess.run(
            command, cwd=REPO, env=trainer_env(metrics_path), capture_output=True, text=True, timeout=timeout
        )
    if result.returncode != 0:
        log = result.stdout + result.stderr
        raise AssertionError(f"trainer exited {result.returncode}; command: {' '.join(command)}\n{log[-6000:]}")
    return read_file_logger(metrics_path)


# ---------------------------------------------------------------- checkpoints
def latest_checkpoint(checkpoint_dir: Path) -> int | None:
    """The step verl's tracker (latest_checkpointed_iteration.txt) names, or None."""
    tracker = Path(checkpoint_dir) / "latest_checkpointed_iteration.txt"
    try:
        text = tracker.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def actor_weights(step_dir: Path) -> dict:
    """The actor's model state dict from a ``global_step_N`` folder (one FSDP rank)."""
    import torch

    state = torch.load(Path(step_dir) / "actor" / "model_world_size_1_rank_0.pt", weights_only=False, map_location="cpu")
    return {name: (value.to_local() if hasattr(value, "to_local") else value) for name, value in state.items()}
