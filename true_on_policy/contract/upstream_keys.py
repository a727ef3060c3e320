"""Where each key a determinism plan emits was found upstream: ``upstream_keys.json`` next to this file.

One entry list per key (an env var, a config key's last part, an in-process call as the plan names
it): the project, its version and commit where known, the file and the snippet found there, and how it
was read -- ``installed`` (re-read from the installed package by the tests) or ``recorded`` (read from
the upstream repository at the commit named, or where no commit is named from the PR or tag named,
and written down; its source is not installed here). A key the plans emit
without an entry is reported by :func:`unlisted`; docs/stacks.md's citation table is :func:`table`
(``python -m true_on_policy.contract.upstream_keys`` prints it).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

MANIFEST = pathlib.Path(__file__).with_name("upstream_keys.json")
FIELDS = ("project", "version", "commit", "file", "snippet", "read")


def load(path: pathlib.Path = MANIFEST) -> dict[str, list[dict[str, str]]]:
    """The manifest: key -> its entries, each with every field of :data:`FIELDS`."""
    manifest = json.loads(path.read_text(encoding="utf-8"))
    for key, entries in manifest.items():
        for entry in entries:
            missing = [f for f in FIELDS if f not in entry]
            if missing or entry["read"] not in ("installed", "recorded"):
                raise ValueError(f"{path}: entry for {key!r} lacks {missing} or has read={entry.get('read')!r}")
    return manifest


def unlisted(keys: Iterable[str], manifest: Mapping[str, Any], path: pathlib.Path = MANIFEST) -> list[str]:
    """One line per emitted key with no entry, naming the key and the manifest file."""
    return [f"{key}: no entry in {path}" for key in sorted(set(keys)) if not manifest.get(key)]


def table(manifest: Mapping[str, list[Mapping[str, str]]]) -> str:
    """The markdown citation table of docs/stacks.md, one row per entry."""
    lines = ["| key | project | version | commit | file | found | read |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for key in sorted(manifest):
        for e in manifest[key]:
            snippet = e["snippet"].replace("|", "\\|")
            lines.append(
                f"| `{key}` | {e['project']} | {e['version'] or '-'} | {e['commit'] or '-'} | `{e['file']}` | `{snippet}` | {e['read']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(load()))
