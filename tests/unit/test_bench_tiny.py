"""Every benchmark is in bench/README.md's index with a tiny mode, and the tiny modes of those that
run in the rollout venv run: a new script left out of the index, or without `--tiny`, fails here
(tests/trainer/test_bench_tiny.py runs the trainer venv's)."""

from __future__ import annotations

import re

import pytest

from bench import index
from tests.bench_tiny import ROOT, run_tiny, scripts_for


def test_the_index_lists_every_script_of_bench_once():
    listed = [script.file for script in index.scripts()]
    assert sorted(listed) == index.script_files()
    assert len(listed) == len(set(listed))


def test_every_python_script_has_a_tiny_mode_in_a_venv_of_the_test_runs():
    for script in index.scripts():
        if script.file.endswith(".py"):
            assert script.tiny in index.TINY_VENVS, f"{script.file}: its tiny mode runs in {script.tiny!r}"
        else:
            assert script.tiny.startswith("none: "), f"{script.file}: say why it has no tiny mode"


def test_each_section_named_is_a_heading_of_the_benchmarks_page():
    headings = [line for line in (ROOT / "docs" / "BENCHMARKS.md").read_text().splitlines() if line.startswith("#")]
    for script in index.scripts():
        if script.section.startswith("none: "):
            continue
        for section in re.split(r"; ", script.section):
            assert any(section in heading for heading in headings), f"{script.file}: no section {section!r}"


@pytest.mark.parametrize("script", scripts_for("rollout"), ids=lambda s: s.file)
def test_the_tiny_mode_runs(script, tmp_path):
    run_tiny(script, tmp_path)
