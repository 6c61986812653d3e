"""Every relative link in README.md and docs/*.md reaches a file that exists, and an `#anchor` into a
Markdown file reaches one of its headings (GitHub's slugs): text moved between pages keeps its links."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)
CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text without fenced blocks and code spans, where a `](` is no link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found, seen = set(), {}
    for line in FENCE.sub("", text).splitlines():
        if match := re.match(r"^#{1,6} +(.*?) *#*$", line):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto:: not a file of the repository
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target} (no such heading)")
    return broken


def test_every_relative_link_reaches_a_file_and_a_heading():
    assert len(PAGES) > 5
    broken = {page.relative_to(ROOT).as_posix(): found for page in PAGES if (found := broken_links(page))}
    assert broken == {}


def test_a_missing_file_or_heading_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# The `spool` contract: files\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#the-spool-contract-files) [ok](other.md#twice-1) [ok](#here) `[code](gone.md)`\n"
        "# Here\n\n[bad](gone.md) [bad](other.md#nothing) [ok](https://example.com/x)\n"
    )
    assert broken_links(page) == ["gone.md (no such file)", "other.md#nothing (no such heading)"]
