"""How often following ``config`` from ``verdict.decide`` changes module: stays and returns.

Method (dynamic, on one real run): compose ``configs/<name>`` (default ``cpu_tiny``) as ``check``
does, then run ``verdict.decide(config, machine=detect_machine(), launching=False)`` under
``sys.setprofile``. Every Python function entered while ``decide`` runs (a ``call`` event, ``decide``
itself included) whose code lives in the ``true_on_policy`` package is a step of the walk when one of
its arguments is *the config or an object derived from it*: an OmegaConf node, or an instance of a
class defined in ``true_on_policy`` (the settings, the views of the two sides, the launch, the plan,
the contract, a row, ...), and that is called from the package (import hooks called by importlib are
not). Calls on plain values only (a string, a number, a dict) are not steps.

The steps, in the order they are entered, are labelled with their module. A *stay* is a maximal run
of consecutive steps in one module; a *return* is a stay in a module the walk had already left
(so returns = stays - modules visited). Prints ``stays``, ``modules`` and ``returns``, then the
stays in order with the functions entered in each (``--quiet``: the three numbers only).

Usage: PYTHONPATH=$PWD python scripts/config_walk.py [--config-name cpu_tiny] [--quiet]
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "true_on_policy") + os.sep


def _derived(value, node_types) -> bool:
    if isinstance(value, node_types):
        return True
    module = getattr(type(value), "__module__", "") or ""
    return module.startswith("true_on_policy")


def walk(config, decide) -> list[tuple[str, str]]:
    """(module, function) of every step of the walk, in the order entered."""
    from omegaconf import DictConfig, ListConfig

    node_types = (DictConfig, ListConfig)
    steps: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE):
            return
        caller = frame.f_back
        if steps and (caller is None or not caller.f_code.co_filename.startswith(PACKAGE)):
            return  # entered from outside the package (an import hook), not along the config's path
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(_derived(frame.f_locals.get(name), node_types) for name in names):
            module = os.path.relpath(code.co_filename, ROOT)[: -len(".py")].replace(os.sep, ".")
            steps.append((module, code.co_qualname))

    sys.setprofile(profile)
    try:
        decide(config)
    finally:
        sys.setprofile(None)
    return steps


def stays(steps: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """Maximal runs of consecutive steps in one module: (module, functions entered)."""
    out: list[tuple[str, list[str]]] = []
    for module, function in steps:
        if out and out[-1][0] == module:
            out[-1][1].append(function)
        else:
            out.append((module, [function]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-name", default="cpu_tiny")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from true_on_policy.cli.check import compose_config
    from true_on_policy.config.platform import detect_machine
    from true_on_policy.contract import verdict

    config = compose_config(os.path.join(ROOT, "configs"), args.config_name)
    machine = detect_machine()
    runs = stays(walk(config, lambda c: verdict.decide(c, machine=machine, launching=False)))
    modules = list(dict.fromkeys(module for module, _ in runs))
    print(f"stays={len(runs)} modules={len(modules)} returns={len(runs) - len(modules)}")
    if not args.quiet:
        for module, functions in runs:
            print(f"  {module}: {', '.join(functions)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
