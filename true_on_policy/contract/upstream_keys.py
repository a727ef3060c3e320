"""Where each key a determinism plan emits was found upstream: ``upstream_keys.json`` next to this file.

One entry list per key (an env var, a config key's last part, an in-process call as the plan names
it): the project, its version (the first word; a note may follow) and commit where known, the file and the
snippet found there (one line of that file, naming the key), and how it was read -- ``installed`` (re-read from
the installed package of that version), ``released`` (re-read from the registry's artifact named in
``artifact``, fetched with its ``sha256`` into :func:`artifacts_dir` by ``python -m true_on_policy fetch-keys``,
which ``make install`` runs) or ``recorded`` (read from the upstream repository at the commit, PR or tag
named, and written down: no released artifact has it). :func:`reread` says which entries were found again,
which were not, and which stay unread and why. A key the plans emit without an entry is reported by
:func:`unlisted`; docs/stacks.md's citation table is :func:`table` (``python -m
true_on_policy.contract.upstream_keys`` prints it).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import pathlib
import sys
from collections.abc import Iterable, Mapping
from typing import Any

MANIFEST = pathlib.Path(__file__).with_name("upstream_keys.json")
FIELDS = ("project", "version", "commit", "file", "snippet", "read")
READS = ("installed", "released", "recorded")
RELEASED_FIELDS = ("artifact", "sha256")  # the registry's file name and its digest, for read == "released"


def load(path: pathlib.Path = MANIFEST) -> dict[str, list[dict[str, str]]]:
    """The manifest: key -> its entries, each with every field of :data:`FIELDS`."""
    manifest = json.loads(path.read_text(encoding="utf-8"))
    for key, entries in manifest.items():
        for entry in entries:
            missing = [f for f in FIELDS + (RELEASED_FIELDS if entry.get("read") == "released" else ()) if f not in entry]
            if missing or entry["read"] not in READS:
                raise ValueError(f"{path}: entry for {key!r} lacks {missing} or has read={entry.get('read')!r}")
    return manifest


def release(entry: Mapping[str, str]) -> str:
    """The version an entry was read at: the first word of its ``version`` (a note may follow)."""
    return entry["version"].split(" ")[0]


def artifacts_dir(prefix: str = sys.prefix) -> pathlib.Path:
    """Where ``fetch-keys`` unpacks the released artifacts: one folder per artifact, named by its file."""
    return pathlib.Path(prefix) / "var" / "true_on_policy" / "upstream"


def names_key(key: str, snippet: str) -> bool:
    """Whether a snippet names its key (the key's last part; ``-`` read as ``_``, as argparse does)."""
    return key.split("(")[0].split(".")[-1] in snippet.replace("-", "_")


@dataclasses.dataclass
class Reread:
    """What :func:`reread` found: one line per entry, naming key, project and version."""

    found: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)  # read again, and the snippet or key is not there
    unread: list[str] = dataclasses.field(default_factory=list)  # with why


def reread(
    manifest: Mapping[str, list[Mapping[str, str]]],
    installed: Mapping[tuple[str, str], pathlib.Path],
    artifacts: pathlib.Path | None = None,
) -> Reread:
    """Read every entry again where its source is at hand: an ``installed`` entry from ``installed`` (project,
    version) -> the folder holding that release's package (:func:`installed_roots`), a ``released`` one from
    its own folder under ``artifacts`` (default :func:`artifacts_dir`)."""
    out = Reread()
    for key, entries in sorted(manifest.items()):
        for e in entries:
            name = f"{key}: {e['project']} {release(e)} {e['file']}"
            root = ((artifacts or artifacts_dir()) / e["artifact"] if e["read"] == "released"
                    else installed.get((e["project"], release(e))))
            if e["read"] == "recorded" or root is None or not root.is_dir():
                why = ("recorded from " + (e["commit"] or e["version"]) if e["read"] == "recorded"
                       else "not installed here" if e["read"] == "installed" else f"{e['artifact']} not fetched")
                out.unread.append(f"{name} ({why})")
                continue
            source = root / e["file"]
            text = source.read_text(encoding="utf-8") if source.is_file() else ""
            if e["snippet"] not in text or "\n" in e["snippet"] or not names_key(key, e["snippet"]):
                out.missing.append(f"{name}: {e['snippet']!r} is not a line of it naming the key")
            else:
                out.found.append(name)
    return out


def unlisted(keys: Iterable[str], manifest: Mapping[str, Any], path: pathlib.Path = MANIFEST) -> list[str]:
    """One line per emitted key with no entry, naming the key and the manifest file."""
    return [f"{key}: no entry in {path}" for key in sorted(set(keys)) if not manifest.get(key)]


def installed_roots(manifest: Mapping[str, list[Mapping[str, str]]]) -> dict[tuple[str, str], pathlib.Path]:
    """Each installed project's release an ``installed`` entry names, found by metadata (not imported):
    (project, version) -> the folder holding its package."""
    roots: dict[tuple[str, str], pathlib.Path] = {}
    modules = importlib.metadata.packages_distributions()
    for project in {e["project"] for es in manifest.values() for e in es if e["read"] == "installed"}:
        module = project.replace("-", "_")
        spec = importlib.util.find_spec(module) if modules.get(module) else None
        if spec is not None and spec.origin:
            version = importlib.metadata.version(modules[module][0]).split("+")[0]
            roots[(project, version)] = pathlib.Path(spec.origin).parent.parent
    return roots


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
