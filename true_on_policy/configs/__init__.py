"""The project's Hydra configs, shipped inside the package: compose them as ``pkg://true_on_policy.configs``.

``common/true_on_policy.yaml`` is the ``true_on_policy:`` section with every key at its default; the
top-level files are runnable jobs (``--config-path pkg://true_on_policy.configs --config-name cpu_tiny``).
The repository's top-level ``configs`` is a link to this folder, not a copy.

verl opens its agent-loop and tool configs by path (relative to the working directory), so a config
names a file shipped here as ``${true_on_policy_config_file:tools/latency_tool.yaml}``: the resolver,
registered on import (Hydra's ``pkg://`` source, ``check`` and the verl plugin import this package),
gives its absolute path in the installed package. ``shapes/<model>/`` holds a model's config.json without
weights: what ``check`` reads of a large model's shapes when no checkpoint is given (a launch needs one).
"""

from pathlib import Path

from omegaconf import OmegaConf

FOLDER = Path(__file__).resolve().parent
RESOLVER = "true_on_policy_config_file"


def config_file(relative: str) -> str:
    """The absolute path of ``relative`` under this folder, a file or a folder (``shapes/<model>``); a name that
    is not shipped here is an error."""
    path = FOLDER / relative
    if not path.exists():
        raise FileNotFoundError(f"${{{RESOLVER}:{relative}}}: no such file in {FOLDER}")
    return str(path)


if not OmegaConf.has_resolver(RESOLVER):
    OmegaConf.register_new_resolver(RESOLVER, config_file)
