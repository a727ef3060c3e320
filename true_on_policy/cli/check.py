"""``python -m true_on_policy check --config-path <dir> --config-name <name> [overrides...]``.

Composes the config exactly as ``python -m verl.trainer.main_ppo --config-path ... --config-name ...``
does (Hydra compose API, the user's directory as the primary config source; verl's packaged config
directory enters through the config's own ``hydra: searchpath: [pkg://verl.trainer.config]``),
resolves it and asks for the launch's verdict (:func:`true_on_policy.contract.verdict.decide`, the
function verl's launch hook calls): its text goes to stderr, the side-by-side contract table to
stdout, and the exit code is the launch's:

* 0 accepted: every row consistent and verified (or accepted by the config),
* 2 refused: a bad value (key, value, what is expected), a broken FlashREINFORCE invariant, a
  platform limit or a contract mismatch,
* 3 refused only for rows that cannot be verified (each named, with the reason);
  ``--accept-unverified ROW`` (repeatable) adds ROW to ``true_on_policy.accept_unverified`` (and
  to the launch command ``--show-command`` prints),
* 1 when the config cannot be composed, or on an internal error (reported as such).

The one difference from the launch: a config whose ``true_on_policy.platform`` names another
platform than this machine's is evaluated as declared (the verdict says it was not detected here),
so a device config can be checked on a CPU machine; the launch refuses it.

Extra flags (before the Hydra overrides): ``--json`` prints the verdict (code, text, settings,
plan, contract) as JSON alone on stdout; ``--plan`` also prints the determinism plan with its sources.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from true_on_policy.cli.json_output import stdout_to_stderr
from true_on_policy.contract.verdict import EXIT_ERROR, EXIT_OK, EXIT_REFUSED, EXIT_UNVERIFIED  # noqa: F401 - the exit codes



# A config folder inside an installed package, as Hydra and verl's main_ppo take it: pkg://true_on_policy.configs
PKG = "pkg://"


def compose_config(config_path: str, config_name: str, overrides: Sequence[str] = ()) -> Any:
    """The resolved config, composed the way ``hydra.main`` composes it for main_ppo."""
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from true_on_policy import configs  # noqa: F401 - registers the resolver the shipped configs use

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    if config_path.startswith(PKG):
        initialize = initialize_config_module(config_module=config_path[len(PKG) :], version_base=None, job_name="true_on_policy_check")
    else:
        config_dir = os.path.abspath(config_path)
        if not os.path.isdir(config_dir):
            raise FileNotFoundError(f"--config-path {config_path!r} is not a directory")
        initialize = initialize_config_dir(config_dir=config_dir, version_base=None, job_name="true_on_policy_check")
    with initialize:
        cfg = compose(config_name=config_name, overrides=list(overrides))
    try:
        OmegaConf.resolve(cfg)
    except Exception as exc:  # noqa: BLE001 - name the key whose interpolation does not resolve
        key, raw = _unresolvable(cfg)
        if key is None:
            raise
        from true_on_policy.config.settings import ConfigError

        raise ConfigError(key, raw, f"does not resolve ({type(exc).__name__}: {exc})") from exc
    return cfg


def _unresolvable(cfg: Any, prefix: str = "") -> tuple[str | None, Any]:
    """The first key (dotted) whose interpolation fails to resolve, and its raw value."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    items = cfg.items_ex(resolve=False) if isinstance(cfg, DictConfig) else enumerate(cfg) if isinstance(cfg, ListConfig) else []
    for key, _ in list(items):
        path = f"{prefix}{key}"
        node = cfg._get_node(key)  # noqa: SLF001 - the raw node, without resolving it
        if isinstance(node, (DictConfig, ListConfig)):
            found = _unresolvable(node, f"{path}.")
            if found[0] is not None:
                return found
        elif OmegaConf.is_interpolation(cfg, key):
            try:
                cfg[key]
            except Exception:  # noqa: BLE001
                return path, node._value()  # noqa: SLF001
    return None, None


def _describe(exc: BaseException) -> str:
    """The exception and its causes on one line (Hydra wraps the real error)."""
    parts = []
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).strip().replace("\n", " ")
        parts.append(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(parts)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m true_on_policy check",
        description="Check that the training and rollout engines of a verl config are pinned identically.",
    )
    parser.add_argument("--config-path", "-cp", required=True, help="directory holding the config, or a package as pkg://true_on_policy.configs")
    parser.add_argument("--config-name", "-cn", required=True, help="config name (without .yaml)")
    parser.add_argument("--json", action="store_true", help="print the contract as JSON")
    parser.add_argument("--plan", action="store_true", help="also print the determinism plan")
    parser.add_argument("--show-config", action="store_true", help="print the resolved config (YAML) first")
    parser.add_argument("--show-command", action="store_true", help="print the verl launch command last")
    parser.add_argument(
        "--command-args",
        action="store_true",
        help="print only the launch command's arguments, NUL-separated (for exec from a shell script)",
    )
    parser.add_argument("--python", default="python", help="interpreter named in the launch command")
    parser.add_argument(
        "--accept-unverified",
        action="append",
        default=[],
        metavar="ROW",
        help="accept this unverified contract row (its field name); repeatable",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for verl.trainer.main_ppo")
    return parser


_FLAGS = ("--json", "--plan", "--show-config", "--show-command", "--command-args", "-h", "--help")


def launch_command(config_path: str, config_name: str, overrides: Sequence[str], plan: Any, python: str = "python") -> list[str]:
    """The verl launch: the user's overrides, then the determinism plan's ``++`` overrides (which win)."""
    from true_on_policy.contract.determinism_plan import hydra_overrides

    return [
        python,
        "-m",
        "verl.trainer.main_ppo",
        f"--config-path={config_path if config_path.startswith(PKG) else os.path.abspath(config_path)}",
        f"--config-name={config_name}",
        *overrides,
        *hydra_overrides(plan),
    ]


def _split_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """argparse would take ``key=value`` overrides as options when they start with ``+``/``++``."""
    known, rest = [], []
    it = iter(argv)
    for arg in it:
        if arg == "--":
            continue
        if arg in ("--config-path", "-cp", "--config-name", "-cn"):
            known.append(arg)
            known.append(next(it, ""))
        elif arg in ("--python", "--accept-unverified"):
            known.append(arg)
            known.append(next(it, ""))
        elif arg.startswith(("--config-path=", "--config-name=", "--python=", "--accept-unverified=")) or arg in _FLAGS:
            known.append(arg)
        else:
            rest.append(arg)
    return known, rest


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "check":
        argv = argv[1:]
    known, overrides = _split_args(argv)
    args = _parser().parse_args(known)
    # --json: what composing imports may print (verl, Hydra) goes to stderr; stdout carries the JSON alone.
    with stdout_to_stderr(args.json):
        code, out, err = _check(args, overrides)
    if out:
        (stdout or sys.stdout).write(out)
        (stdout or sys.stdout).flush()
    if err:
        print(err, file=stderr or sys.stderr)
    return code


def _check(args: argparse.Namespace, overrides: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout text, stderr text) of one check."""
    from omegaconf.errors import OmegaConfBaseException

    from true_on_policy.config.platform import detect_machine
    from true_on_policy.config.settings import ConfigError
    from true_on_policy.contract import determinism_plan
    from true_on_policy.contract.consistency import format_table
    from true_on_policy.contract.verdict import decide

    try:
        cfg = compose_config(args.config_path, args.config_name, overrides)
        overrides = _accept(cfg, overrides, args.accept_unverified)
    except ConfigError as exc:
        return EXIT_REFUSED, "", f"true_on_policy check: bad config value: {exc}"
    except OmegaConfBaseException as exc:  # an override or interpolation that cannot resolve names its key
        key = getattr(exc, "full_key", None)
        return EXIT_REFUSED, "", f"true_on_policy check: bad config value: {key + ': ' if key else ''}{_describe(exc)}"
    except Exception as exc:  # noqa: BLE001 - one readable line, the exit code says the rest
        return EXIT_ERROR, "", f"true_on_policy check: cannot compose the config: {_describe(exc)}"
    try:
        verdict = decide(cfg, machine=detect_machine(), launching=False)
    except Exception as exc:  # noqa: BLE001 - a bug here, not a config problem: say so
        return EXIT_ERROR, "", f"true_on_policy check: internal error: {_describe(exc)}"
    plan = verdict.plan
    command = launch_command(args.config_path, args.config_name, overrides, plan, args.python) if plan else None
    if args.command_args:
        if command is None:  # refused before a plan exists: the launch would refuse the same way
            return verdict.code, "", verdict.text
        return EXIT_OK, "\0".join(command) + "\0", ""
    out: list[str] = []
    if args.json:
        out.append(json.dumps({**verdict.as_dict(), "launch_command": command}, indent=2, default=str))
    else:
        if args.show_config and plan is not None:
            from omegaconf import OmegaConf

            out += ["# resolved config (determinism plan applied)", OmegaConf.to_yaml(determinism_plan.apply_to_config(cfg, plan))]
        if verdict.contract is not None:
            out.append(format_table(verdict.contract))
        if args.plan and plan is not None:
            out.append(determinism_plan.describe(plan))
        if args.show_command and command is not None:
            import shlex

            out += ["# launch command", " ".join(shlex.quote(part) for part in command)]
    return verdict.code, "".join(f"{part}\n" for part in out), verdict.text


def _accept(cfg: Any, overrides: list[str], rows: Sequence[str]) -> list[str]:
    """``--accept-unverified ROW``: ROW joins ``true_on_policy.accept_unverified`` in ``cfg`` and in the
    overrides of the launch command, so the launch decides the same way."""
    section = cfg.get("true_on_policy") if rows else None
    if section is None:
        return list(overrides)
    from omegaconf import open_dict

    names = list(dict.fromkeys([*(section.get("accept_unverified") or []), *rows]))
    with open_dict(section):
        section.accept_unverified = names
    kept = [o for o in overrides if not o.lstrip("+").startswith("true_on_policy.accept_unverified=")]
    return [*kept, f"true_on_policy.accept_unverified=[{','.join(names)}]"]


if __name__ == "__main__":
    sys.exit(main())
