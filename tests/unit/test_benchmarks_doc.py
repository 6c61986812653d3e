"""docs/BENCHMARKS.md as a reader meets it: a summary table first, whose rows lead to sections
that exist and name bench/ scripts that exist. The checks are functions of the text, so the
tests at the bottom can show each one rejecting a broken document."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "BENCHMARKS.md"
HISTORY = ROOT / "docs" / "BENCHMARKS_HISTORY.md"

SUMMARY_COLUMNS = ["what", "value", "against", "machine", "date", "command", "section"]
LINK = re.compile(r"\[[^\]]*\]\(#([^)]+)\)")
HISTORY_LINK = re.compile(r"\(BENCHMARKS_HISTORY\.md#([^)]+)\)")
# A command names a script as a module (python -m bench.NAME) or, for shell scripts, by path.
BENCH_MODULE = re.compile(r"-m +bench\.(\w+)")
BENCH_PATH = re.compile(r"\bbench/[\w./-]+")
FENCE = re.compile(r"^(```|~~~)")


def heading_slugs(text: str) -> set[str]:
    """GitHub's anchors: lowercase, punctuation but hyphens and underscores dropped, spaces to
    hyphens; a repeated heading gets -1, -2, ... Headings inside fenced blocks do not count."""
    slugs: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        match = re.match(r"^#{1,6} +(.*?) *#* *$", line)
        if in_fence or not match:
            continue
        base = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        count = seen.get(base, 0)
        seen[base] = count + 1
        slugs.add(base if count == 0 else f"{base}-{count}")
    return slugs


def table_cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def summary_rows(text: str) -> list[list[str]]:
    """The rows of the first table, which must come before the document's first measurement
    section (the first level-2 heading other than the summary's own)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    assert start is not None, "no table in the document"
    first_section = next(
        (i for i, line in enumerate(lines) if line.startswith("## ") and line != "## Summary"),
        len(lines),
    )
    assert start < first_section, "the first table comes after the first measurement section"
    assert table_cells(lines[start]) == SUMMARY_COLUMNS, f"summary header is {lines[start]!r}"
    assert set(lines[start + 1].replace("|", "").split()) == {"---"}, "no header separator"
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = table_cells(line)
        assert len(cells) == len(SUMMARY_COLUMNS), f"row with {len(cells)} cells: {line!r}"
        rows.append(cells)
    assert rows, "the summary table has no rows"
    return rows


def broken_links(text: str) -> list[str]:
    """Each summary row's section link, where it names no heading of the document."""
    slugs = heading_slugs(text)
    broken = []
    for row in summary_rows(text):
        anchors = LINK.findall(row[-1])
        if len(anchors) != 1:
            broken.append(f"{row[0]}: section cell {row[-1]!r} is not one link")
        elif anchors[0] not in slugs:
            broken.append(f"{row[0]}: #{anchors[0]}")
    return broken


def missing_scripts(text: str, root: Path) -> list[str]:
    """bench/ paths named in the summary's command column that are not files under root."""
    named = [
        path
        for row in summary_rows(text)
        for path in BENCH_PATH.findall(row[5]) + [f"bench/{name}.py" for name in BENCH_MODULE.findall(row[5])]
    ]
    assert named, "no row's command names a bench/ script"
    return [path for path in named if not (root / path).is_file()]


def test_summary_rows_link_to_headings_that_exist():
    assert broken_links(DOC.read_text()) == []


def test_summary_commands_name_bench_scripts_that_exist():
    assert missing_scripts(DOC.read_text(), ROOT) == []


def test_links_into_the_history_name_its_headings():
    anchors = HISTORY_LINK.findall(DOC.read_text())
    assert anchors, "BENCHMARKS.md does not point to its superseded runs"
    slugs = heading_slugs(HISTORY.read_text())
    assert [anchor for anchor in anchors if anchor not in slugs] == []


# The checks above, shown failing on documents broken the ways they guard against.

GOOD = """# Benchmarks

## Summary

| what | value | against | machine | date | command | section |
| --- | --- | --- | --- | --- | --- | --- |
| round trip | 5 ms | 7 | cpu | 12-01 | `python -m bench.spool_roundtrip` | [Spool, again](#spool-again-the-2nd-run) |
| build | 1 s | 2 s | cpu | 12-01 | `bench/build_trl_bundle.sh` | [Spool, again](#spool-again-the-2nd-run) |

## Spool, again: the 2nd run
"""


def test_slugs_follow_githubs_rule():
    text = "# A `b`: c.d, 1.5B (x_y)\n## Reading\n## Reading\n```\n# not a heading\n```\n"
    assert heading_slugs(text) == {"a-b-cd-15b-x_y", "reading", "reading-1"}


def test_a_good_document_passes():
    assert broken_links(GOOD) == []
    assert missing_scripts(GOOD, ROOT) == []


def test_a_link_to_no_heading_is_reported():
    text = GOOD.replace("(#spool-again-the-2nd-run)", "(#spool-again)", 1)
    assert broken_links(text) == ["round trip: #spool-again"]


def test_a_row_without_a_link_is_reported():
    text = GOOD.replace("[Spool, again](#spool-again-the-2nd-run)", "Spool", 1)
    assert len(broken_links(text)) == 1


def test_a_missing_module_is_reported():
    text = GOOD.replace("-m bench.spool_roundtrip", "-m bench.no_such_bench")
    assert missing_scripts(text, ROOT) == ["bench/no_such_bench.py"]


def test_a_missing_shell_script_is_reported():
    text = GOOD.replace("bench/build_trl_bundle.sh", "bench/no_such_bundle.sh")
    assert missing_scripts(text, ROOT) == ["bench/no_such_bundle.sh"]


def test_a_summary_after_the_first_section_is_rejected():
    body = GOOD.split("## Summary\n", 1)[1]
    text = "# Benchmarks\n\n## Spool\n\nprose\n\n## Summary\n" + body
    with pytest.raises(AssertionError, match="after the first measurement section"):
        summary_rows(text)


def test_a_document_without_a_table_is_rejected():
    with pytest.raises(AssertionError, match="no table"):
        summary_rows("# Benchmarks\n\n## Spool\n")
