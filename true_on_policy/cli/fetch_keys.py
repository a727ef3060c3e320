"""``python -m true_on_policy fetch-keys``: fetch the released artifacts the upstream-keys manifest cites.

Every ``released`` entry of ``contract/upstream_keys.json`` names a file on the package registry (PyPI) and its
sha256. This downloads each one once (a wheel or an sdist), checks the digest, and unpacks it under
:func:`true_on_policy.contract.upstream_keys.artifacts_dir` (one folder per file; an sdist's top folder is
dropped so the manifest's paths hold for both). Then it reads every entry again (:func:`upstream_keys.reread`)
and prints how many were found in released or installed source and names the rest; exit 1 when an entry read
again is not there. ``make install`` runs it, so the tests need no network.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import pathlib
import shutil
import sys
import tarfile
import tempfile
import urllib.request
import zipfile

from true_on_policy.contract import upstream_keys

# The registry's project index in its JSON form (PEP 691): every file with its absolute URL.
REGISTRY = "https://pypi.org/simple/{project}/"
INDEX_JSON = "application/vnd.pypi.simple.v1+json"


@functools.cache
def _index(project: str) -> dict[str, str]:
    """The registry's files of one project, name -> URL (read once per project)."""
    request = urllib.request.Request(REGISTRY.format(project=project), headers={"Accept": INDEX_JSON})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return {f["filename"]: f["url"] for f in json.load(reply)["files"]}


def _url(project: str, artifact: str) -> str:
    url = _index(project).get(artifact)
    if url is None:
        raise SystemExit(f"fetch-keys: the registry's {project} has no file {artifact!r}")
    return url


def _unpack(archive: pathlib.Path, folder: pathlib.Path) -> None:
    tmp = pathlib.Path(tempfile.mkdtemp(dir=folder.parent))
    try:
        if folder.name.endswith(".whl"):
            with zipfile.ZipFile(archive) as z:
                z.extractall(tmp)
            top = tmp
        else:
            with tarfile.open(archive) as t:
                t.extractall(tmp, filter="data")
            (top,) = tmp.iterdir()  # an sdist holds one folder, <name>-<version>/
        top.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch(entry: dict[str, str], into: pathlib.Path) -> pathlib.Path:
    """The unpacked artifact of one ``released`` entry, downloaded and digest-checked unless already there."""
    folder = into / entry["artifact"]
    if folder.is_dir():
        return folder
    into.mkdir(parents=True, exist_ok=True)
    url = _url(entry["project"], entry["artifact"])
    archive = into / (entry["artifact"] + ".part")
    with urllib.request.urlopen(url, timeout=300) as reply, archive.open("wb") as out:
        shutil.copyfileobj(reply, out)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != entry["sha256"]:
        archive.unlink()
        raise SystemExit(f"fetch-keys: {entry['artifact']} has sha256 {digest}, the manifest says {entry['sha256']}")
    try:
        _unpack(archive, folder)
    finally:
        archive.unlink()
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m true_on_policy fetch-keys", description=__doc__.split("\n")[0])
    parser.add_argument("--into", type=pathlib.Path, default=upstream_keys.artifacts_dir(), help="default: %(default)s")
    args = parser.parse_args(argv)
    manifest = upstream_keys.load()
    for entries in manifest.values():
        for e in entries:
            if e["read"] == "released":
                fetch(e, args.into)
    result = upstream_keys.reread(manifest, upstream_keys.installed_roots(manifest), args.into)
    print(f"upstream keys: {len(result.found)} entries read again from released or installed source, "
          f"{len(result.missing)} not found, {len(result.unread)} unread")
    for line in result.missing:
        print(f"  NOT FOUND {line}")
    for line in result.unread:
        print(f"  unread    {line}")
    return 1 if result.missing else 0


if __name__ == "__main__":
    sys.exit(main())
