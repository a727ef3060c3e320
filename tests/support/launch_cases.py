"""verl's real launch, ``python -m verl.trainer.main_ppo``, once per case, in one process, up to Ray.

Reads ``[[config_name, [overrides...]], ...]`` as JSON on stdin; for each case sets ``sys.argv`` as
the command line would and calls ``verl.trainer.main_ppo.main`` (Hydra's entry: it composes the
config from argv and runs verl's ``main``, whose first call is the plugin's launch hook). Every case
gets ``++ray_kwargs.ray_init.<STOP_KEY>=1``: ``ray.init`` refuses the unknown keyword before it starts
anything, so a launch the hook accepted stops right after verl's own validation, at ``ray.init``.

Prints one JSON record per case on stdout: the exit code (0 = verl reached ``ray.init``), what the
hook wrote on stderr, and whether ``ray.init`` was reached. One interpreter for every case: verl is
imported once (the launch's own cost), the environment is restored between cases.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

STOP_KEY = "true_on_policy_stop_before_ray"
STOP_OVERRIDE = f"++ray_kwargs.ray_init.{STOP_KEY}=1"


def launch(config_dir: str, config_name: str, overrides: list[str]) -> dict:
    from hydra.core.global_hydra import GlobalHydra
    from verl.trainer import main_ppo

    saved_env, saved_argv = dict(os.environ), list(sys.argv)
    sys.argv = ["main_ppo.py", f"--config-path={config_dir}", f"--config-name={config_name}", *overrides, STOP_OVERRIDE]
    err = io.StringIO()
    code, reached_ray, error = None, False, ""
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(sys.stderr):
            main_ppo.main()
        code, error = 1, "main_ppo.main returned without reaching ray.init"
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except RuntimeError as exc:
        if STOP_KEY not in str(exc):
            raise
        code, reached_ray = 0, True
    except Exception as exc:  # noqa: BLE001 - verl refused the config after our hook: report it
        code, error = 1, f"{type(exc).__name__}: {exc}"
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
        GlobalHydra.instance().clear()
    return {"code": code, "stderr": err.getvalue(), "reached_ray": reached_ray, "error": error}


def main() -> int:
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing and exiting 1
    config_dir = sys.argv[1]
    cases = json.load(sys.stdin)
    for config_name, overrides in cases:
        record = launch(config_dir, config_name, overrides)
        print(json.dumps({"config": config_name, "overrides": overrides, **record}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
