"""``python -m true_on_policy check --config-path <dir> --config-name <name> [overrides...]``.

Composes the config exactly as ``python -m verl.trainer.main_ppo --config-path ... --config-name ...``
does (Hydra compose API, the user's directory as the primary config source; verl's packaged config
directory enters through the config's own ``hydra: searchpath: [pkg://verl.trainer.config]``),
resolves it, applies the determinism plan, prints the side-by-side contract table and exits

* 0 when every row is consistent *and* verified for the installed (or declared) stack versions,
* 2 on a mismatch (one line per mismatch on stderr) or a bad value (the key, the value, what is expected),
* 3 when every row is consistent where it can be seen but some rows cannot be verified (one line per
  row on stderr, with the reason); ``--accept-unverified ROW`` (repeatable) or
  ``true_on_policy.accept_unverified`` accepts a named row, and exit 0 follows when all are accepted,
* 1 when the config cannot be composed, or on an internal error (reported as such).

Extra flags (before the Hydra overrides): ``--json`` prints the contract as JSON instead of the
table; ``--plan`` also prints the determinism plan with its sources.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

EXIT_OK, EXIT_ERROR, EXIT_MISMATCH, EXIT_UNVERIFIED = 0, 1, 2, 3


def compose_config(config_path: str, config_name: str, overrides: Sequence[str] = ()) -> Any:
    """The resolved config, composed the way ``hydra.main`` composes it for main_ppo."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    config_dir = os.path.abspath(config_path)
    if not os.path.isdir(config_dir):
        raise FileNotFoundError(f"--config-path {config_path!r} is not a directory")
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None, job_name="true_on_policy_check"):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    try:
        OmegaConf.resolve(cfg)
    except Exception as exc:  # noqa: BLE001 - name the key whose interpolation does not resolve
        key, raw = _unresolvable(cfg)
        if key is None:
            raise
        from true_on_policy.contract.determinism_plan import ConfigError

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
    parser.add_argument("--config-path", "-cp", required=True, help="directory holding the config")
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
    from true_on_policy.contract import determinism_plan as determinism_env

    return [
        python,
        "-m",
        "verl.trainer.main_ppo",
        f"--config-path={os.path.abspath(config_path)}",
        f"--config-name={config_name}",
        *overrides,
        *determinism_env.hydra_overrides(plan),
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
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "check":
        argv = argv[1:]
    known, overrides = _split_args(argv)
    args = _parser().parse_args(known)

    from true_on_policy.contract import consistency as contract_mod
    from true_on_policy.contract import determinism_plan as determinism_env

    from omegaconf.errors import OmegaConfBaseException

    from true_on_policy.contract.determinism_plan import ConfigError

    try:
        cfg = compose_config(args.config_path, args.config_name, overrides)
    except ConfigError as exc:
        print(f"true_on_policy check: bad config value: {exc}", file=stderr)
        return EXIT_MISMATCH
    except OmegaConfBaseException as exc:  # an override or interpolation that cannot resolve names its key
        key = getattr(exc, "full_key", None)
        print(f"true_on_policy check: bad config value: {key + ': ' if key else ''}{_describe(exc)}", file=stderr)
        return EXIT_MISMATCH
    except Exception as exc:  # noqa: BLE001 - one readable line, the exit code says the rest
        print(f"true_on_policy check: cannot compose the config: {_describe(exc)}", file=stderr)
        return EXIT_ERROR
    try:
        recipe = determinism_env.recipe_settings(cfg)
        plan = determinism_env.plan_for_config(cfg)
        result = contract_mod.build_contract(cfg, plan=plan)
        accepted = verdict_acceptance(result, [*recipe.accept_unverified, *args.accept_unverified])
    except ValueError as exc:  # ConfigError and Settings validation: key, value, what is expected
        print(f"true_on_policy check: bad config value: {exc}", file=stderr)
        return EXIT_MISMATCH
    except Exception as exc:  # noqa: BLE001 - a bug here, not a config problem: say so
        print(f"true_on_policy check: internal error: {_describe(exc)}", file=stderr)
        return EXIT_ERROR
    command = launch_command(args.config_path, args.config_name, overrides, plan, args.python)
    if args.command_args:
        stdout.write("\0".join(command) + "\0")
        stdout.flush()
        return EXIT_OK
    mismatches = contract_mod.compare(result)
    if args.show_config:
        from omegaconf import OmegaConf

        print("# resolved config (determinism plan applied)", file=stdout)
        print(OmegaConf.to_yaml(determinism_env.apply_to_config(cfg, plan)), file=stdout)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2, default=str), file=stdout)
    else:
        print(contract_mod.format_table(result, mismatches), file=stdout)
    if args.plan:
        print(determinism_env.describe(plan), file=stdout)
    if args.show_command:
        import shlex

        print("# launch command", file=stdout)
        print(" ".join(shlex.quote(part) for part in command), file=stdout)
    if mismatches:
        for m in mismatches:
            print(m.line(), file=stderr)
        return EXIT_MISMATCH
    open_rows = [(row, reason) for row, reason in contract_mod.unverified(result) if row.field not in accepted]
    for row, reason in contract_mod.unverified(result):
        if row.field in accepted:
            print(f"accepted unverified: {row.field}: {reason}", file=stdout)
    if open_rows:
        for row, reason in open_rows:
            print(f"UNVERIFIED {row.title} [{row.field}]: {reason}", file=stderr)
        fields = " ".join(f"--accept-unverified {row.field}" for row, _ in open_rows)
        print(f"cannot verify {len(open_rows)} row(s); to go on anyway: {fields}", file=stderr)
        return EXIT_UNVERIFIED
    return EXIT_OK


def verdict_acceptance(result: Any, names: Sequence[str]) -> set[str]:
    """The accepted row names; a name that is no row of the contract is a ValueError naming it."""
    fields = [row.field for row in result.rows]
    unknown = sorted(set(names) - set(fields))
    if unknown:
        raise ValueError(f"--accept-unverified / true_on_policy.accept_unverified={unknown}: not contract rows; rows are {fields}")
    return set(names)


if __name__ == "__main__":
    sys.exit(main())
