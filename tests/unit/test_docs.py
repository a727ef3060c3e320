"""The documentation a newcomer reads: README fits its budget and no relative link is dangling."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README_BUDGET_BYTES = 12_000
DOCS = [REPO / "README.md", REPO / "recipe" / "true_on_policy" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def relative_links(text: str) -> list[str]:
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+://", target)]


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
