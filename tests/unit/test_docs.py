"""The documentation a newcomer reads: README fits its budget, no relative link is dangling, and every
repository file a doc cites (a link, a backticked path, a path in a code block) exists."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README_BUDGET_BYTES = 12_000
DOCS = [REPO / "README.md", REPO / "recipe" / "true_on_policy" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# A dated entry describes the tree of its date; the files it names may have moved or gone since.
DATED = {"docs/journal.md"}
# Paths in other repositories (verl's docs, torch_npu's, the Ascend recipe's scripts) that share a first
# folder with this one.
UPSTREAM = ("docs/ascend_tutorial/", "docs/zh/", "docs/source/", "true_on_policy/scripts/")  # paths in upstream repositories
SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^\s*```")


def relative_links(text: str) -> list[str]:
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+://", target)]


def path_roots(repo: Path) -> list[Path]:
    """Where a cited path may start: the repository, the package (docs say `kernels/ops.py`)."""
    return [repo, repo / "true_on_policy"]


def cited_paths(text: str, repo: Path) -> list[tuple[int, str, str]]:
    """(line, path, name) of every path that starts with a folder of a root, in backticks or in a code block;
    `name` is a `::name` suffix ('' if none), a `:line` or `#anchor` suffix ends the path, `{a,b}` stands for
    both, a pattern is skipped."""
    firsts = sorted({p.name for root in path_roots(repo) if root.is_dir() for p in root.iterdir()
                     if p.is_dir() and not p.name.startswith((".", "_"))})
    if not firsts:
        return []
    token = re.compile(r"(?<![\w$./:~-])((?:%s)/[\w./+{},*<>…-]*)(?:::(\w+))?" % "|".join(map(re.escape, firsts)))
    cited, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        for chunk in [line] if fenced else SPAN.findall(line):
            for path, name in token.findall(chunk):
                path = path.rstrip(".,")
                if any(mark in path for mark in ("...", "…", "*", "<")):
                    continue
                cited += [(number, expanded, name) for expanded in expand_braces(path)]
    return cited


def expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    head, tail = path[:match.start()], path[match.end():]
    return [expanded for alt in match.group(1).split(",") for expanded in expand_braces(head + alt + tail)]


def missing_paths(doc: Path, repo: Path) -> list[str]:
    """'doc:line: path' for each cited path found under none of the roots nor beside the doc, and
    'doc:line: path::name' for a `::name` the file found defines nowhere (def or class)."""
    shown = doc.relative_to(repo).as_posix()
    if shown in DATED:
        return []
    missing = []
    for number, path, name in cited_paths(doc.read_text(), repo):
        found = [root / path for root in [*path_roots(repo), doc.parent] if (root / path).exists()]
        if path.startswith(UPSTREAM):
            continue
        if not found:
            missing.append(f"{shown}:{number}: {path}")
        elif name and found[0].is_file() and not defines(found[0].read_text(), name):
            missing.append(f"{shown}:{number}: {path}::{name}")
    return missing


def defines(source: str, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b", source, re.M) is not None


def test_readme_fits_its_budget():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_BUDGET_BYTES, f"README.md is {size} bytes, the budget is {README_BUDGET_BYTES}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc):
    missing = [t for t in relative_links(doc.read_text()) if not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(REPO)} links to missing files: {missing}"


def test_the_link_check_sees_a_dangling_link(tmp_path):
    """Twin: a link to a file that does not exist is reported."""
    doc = tmp_path / "x.md"
    doc.write_text("[a](exists.md) [b](gone.md#part) [c](https://example.org/y.md)")
    (tmp_path / "exists.md").write_text("")
    assert [t for t in relative_links(doc.read_text()) if not (doc.parent / t).exists()] == ["gone.md"]


def test_every_cited_file_exists():
    missing = [entry for doc in DOCS for entry in missing_paths(doc, REPO)]
    assert not missing, "cited files that do not exist:\n" + "\n".join(missing)


def test_the_citation_check_sees_a_missing_file(tmp_path):
    """Twin: a cited path that does not exist is reported with its doc and line, wherever it is cited."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_here.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "true_on_policy" / "kernels").mkdir(parents=True)
    (tmp_path / "true_on_policy" / "kernels" / "ops.py").write_text("")
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "x.md"
    doc.write_text(
        "`tests/test_here.py::test_a` and `pytest tests/test_gone.py -k x`, `tests/test_here.py::test_b`\n"
        "`kernels/ops.py:12`, `kernels/{ops,model}.py`, `tests/test_*.py`, `docs/zh/upstream.md`\n"
        "```\nkernels/ops.py   kernels/layers.py, tests/test_here.py\n```\n"
    )
    assert missing_paths(doc, tmp_path) == [
        "docs/x.md:1: tests/test_gone.py",
        "docs/x.md:1: tests/test_here.py::test_b",
        "docs/x.md:2: kernels/model.py",
        "docs/x.md:4: kernels/layers.py",
    ]
