"""The guarantees table (docs/guarantees.md) names, for each promise, the tests that prove it: every file and
test it names exists, so a renamed or deleted test cannot leave a promise unproven unnoticed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def guarantee_rows() -> list[tuple[str, str]]:
    section = (ROOT / "docs" / "guarantees.md").read_text()
    header = ("| guarantee", "| ---")
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith(header)]
    return [tuple(cell.strip() for cell in row.strip("|").rsplit("|", 1)) for row in rows]


def references(proof: str) -> list[tuple[str, str | None]]:
    """(file, test name or None) for each `tests/...` or `::name` reference of a proof cell; a bare
    `::name` belongs to the file named before it."""
    found, current = [], None
    for ref in re.findall(r"`([^`]+)`", proof):
        path, _, name = ref.partition("::")
        if path:
            current = path
        found.append((current, name.split("[")[0] or None))
    return found


def test_every_guarantee_names_tests_that_exist():
    rows = guarantee_rows()
    assert len(rows) >= 10
    for promise, proof in rows:
        refs = references(proof)
        assert refs, f"no test named for: {promise}"
        for path, name in refs:
            assert path is not None and path.startswith("tests/"), (promise, path)
            file = ROOT / path
            assert file.exists(), f"{path} (for: {promise}) does not exist"
            if file.is_file():
                tests = {
                    node.name
                    for node in ast.walk(ast.parse(file.read_text()))
                    if isinstance(node, ast.FunctionDef) and node.name.startswith("test")
                }
                assert tests, f"{path} holds no test"
                assert name is None or name in tests, f"{path}::{name} (for: {promise}) does not exist"
