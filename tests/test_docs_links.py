"""Every relative link in README.md, CHANGELOG.md and docs/*.md leads somewhere: the file or
directory exists, and a `#fragment` names a heading of the target page (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])

LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def prose(text: str) -> str:
    """The page without fenced code blocks and inline code (links are not read there)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (hyphens and
    underscores kept), spaces to hyphens."""
    s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link's text
    s = s.strip().lower().replace("`", "").replace("*", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text()))


def test_the_pages_exist():
    names = {p.name for p in PAGES}
    for need in ("README.md", "CHANGELOG.md", "quickstart.md", "operations.md", "troubleshooting.md",
                 "results.md", "vllm.md", "sglang.md"):
        assert need in names, f"{need} is missing"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):    # http:, https:, mailto:, file:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            shown = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
            broken.append(f"{target}: {shown} does not exist")
            continue
        if fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_checker_finds_a_broken_link_and_a_missing_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A `code` heading (with: punctuation)\n\n"
                    "[ok](#title) [ok](#a-code-heading-with-punctuation) [bad](#nowhere) [gone](missing.md)\n"
                    "```\n[not a link](inside-a-fence.md)\n```\n")
    assert anchors(page) == {"title", "a-code-heading-with-punctuation"}
    assert links(page) == ["#title", "#a-code-heading-with-punctuation", "#nowhere", "missing.md"]


def test_the_readme_lists_every_page_with_its_job():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Docs\n"):]
    section = section[:section.find("\n## ", 5)] if "\n## " in section[5:] else section
    listed = set(re.findall(r"^- \[[^\]]*\]\(docs/([^)#]+)\): \S", section, re.M))
    pages = {p.name for p in (ROOT / "docs").iterdir() if p.suffix in (".md", ".json")}
    assert pages <= listed, f"README.md's Docs section lacks {sorted(pages - listed)}"
