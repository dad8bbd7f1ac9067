"""The user documentation (README.md and docs/*.md): a short README, and links that lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
FILES = [README, *DOCS]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)  # fenced code blocks
CODE = re.compile(r"`[^`\n]*`")  # inline code spans
LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title"), images too
REFERENCE = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)  # [label]: target


def _links(markdown: str) -> list[str]:
    """The link targets of a markdown text, outside code."""
    text = CODE.sub("x", FENCE.sub("", markdown))
    return LINK.findall(text) + REFERENCE.findall(text)


def _targets(path: Path) -> list[str]:
    return _links(path.read_text())


def _relative(target: str) -> str | None:
    """The path part of a relative link; None for web links, mail and pure anchors."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("#", "//")):
        return None
    return target.split("#", 1)[0].split("?", 1)[0] or None


def test_docs_exist():
    assert README.is_file() and DOCS


def test_readme_is_at_most_300_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= 300, f"README.md has {lines} lines; move detail into docs/"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    missing = [t for t in _targets(path) if (rel := _relative(t)) and not (path.parent / rel).exists()]
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reference_outside_the_repository(path: Path):
    assert "../shared" not in path.read_text()
    for target in _targets(path):
        rel = _relative(target)
        if rel:
            resolved = (path.parent / rel).resolve()
            assert resolved == ROOT or ROOT in resolved.parents, f"{path.relative_to(ROOT)} links outside the repository: {target}"


def test_readme_links_every_doc():
    linked = {(ROOT / rel).resolve() for t in _targets(README) if (rel := _relative(t))}
    assert not [d.name for d in DOCS if d.resolve() not in linked]


def test_link_finder_reads_markdown_links():
    """The checks above see every form of link the documents use, and nothing in code."""
    text = '[a](x.md) [`b`](../y/#z) ![c](p.png "t") [d](https://e.org) [f](#g)\n`[h](no.md)`\n```\n[i](no.md)\n```\n[j]: k.md\n'
    assert _links(text) == ["x.md", "../y/#z", "p.png", "https://e.org", "#g", "k.md"]
    assert [_relative(t) for t in ("x.md#a", "https://e.org", "#g", "mailto:a@b", "../y/")] == ["x.md", None, None, None, "../y/"]
