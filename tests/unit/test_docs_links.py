"""Every relative link in README.md and docs/**/*.md points to a file that exists, and every #anchor to a heading.

Links inside fenced code blocks and inline code are not links. External links (http, https, mailto) are not
fetched. Anchors follow GitHub's heading slugs (lower case, punctuation dropped, spaces to hyphens, ``-1``,
``-2``... for repeats). All broken links are reported at once.
"""

from __future__ import annotations

import re
import sys
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"""<a\s+(?:name|id)=["']([^"']+)["']""")


def markdown_files() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code removed."""
    out: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, _INLINE_CODE.sub("", line)))
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading text: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every anchor a Markdown file defines (headings, with GitHub's -N suffixes for repeats; <a name/id>)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        out.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return frozenset(out)


def broken_links(path: Path) -> list[str]:
    """``file:line: target (why)`` for each relative link of ``path`` that points nowhere."""
    problems: list[str] = []
    rel = path.relative_to(REPO)
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = path if not file_part else (path.parent / unquote(file_part)).resolve()
            if not dest.exists():
                problems.append(f"{rel}:{number}: {target} (no such file)")
                continue
            if anchor and dest.is_file() and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
                problems.append(f"{rel}:{number}: {target} (no heading #{anchor} in {dest.relative_to(REPO)})")
    return problems


def test_every_relative_link_in_the_docs_points_to_an_existing_file_and_heading() -> None:
    problems = [p for f in markdown_files() for p in broken_links(f)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_docs_index_lists_every_docs_page() -> None:
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    linked = {(REPO / "docs" / t.partition("#")[0]).resolve() for _, line in _prose_lines(index)
              for t in _LINK.findall(line) if not t.startswith(("http:", "https:", "#"))}
    missing = [str(p.relative_to(REPO)) for p in sorted((REPO / "docs").rglob("*.md"))
               if p.name != "README.md" and p.resolve() not in linked]
    assert not missing, f"docs/README.md does not link: {missing}"


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("The split of one request (micro-requests)", "the-split-of-one-request-micro-requests"),
        ("`fulcrum replay`", "fulcrum-replay"),
        ("Cross-field rules (CEL)", "cross-field-rules-cel"),
        ("spec.scaling", "specscaling"),
        ("DOPD eqs. 11–14: D capacity", "dopd-eqs-1114-d-capacity"),
    ],
)
def test_headings_get_githubs_anchor(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_the_checker_reports_a_missing_file_a_missing_anchor_and_ignores_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n", encoding="utf-8")
    page.write_text(
        "# Page\n"
        "[ok](other.md#a-section) [ok too](#page) ![img](missing.png)\n"
        "[bad anchor](other.md#nowhere) `[in code](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "[web](https://example.com/x.md)\n",
        encoding="utf-8",
    )
    problems = broken_links(page)
    assert problems == [
        "page.md:2: missing.png (no such file)",
        "page.md:3: other.md#nowhere (no heading #nowhere in other.md)",
    ]
