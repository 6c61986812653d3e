"""The repository's shape: separate venvs, no imports across services, CI runs the README's command."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENVS = ROOT / ".venvs"


def imported_top_levels(package_dir: Path) -> set[str]:
    names = set()
    for path in package_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(
    "package, forbidden",
    [
        ("protocol/src/protocol", {"rollout_svc", "trainer_svc", "torch", "vllm", "transformers"}),
        ("rollout_svc/src/rollout_svc", {"trainer_svc"}),
        ("trainer_svc/src/trainer_svc", {"rollout_svc", "vllm"}),
    ],
)
def test_services_never_import_each_other(package, forbidden):
    assert imported_top_levels(ROOT / package) & forbidden == set()


@pytest.mark.parametrize(
    "venv, importable, absent",
    [("rollout", "rollout_svc", "trainer_svc"), ("trainer", "trainer_svc", "rollout_svc")],
)
def test_each_venv_holds_its_service_and_protocol_only(venv, importable, absent, tmp_path):
    # Run outside the repository, where the source folders would import as namespace packages.
    python = VENVS / venv / "bin" / "python"
    ok = subprocess.run([python, "-c", f"import protocol, {importable}"], capture_output=True, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr.decode()
    missing = subprocess.run([python, "-c", f"import {absent}"], capture_output=True, cwd=tmp_path)
    assert missing.returncode != 0


def test_make_venvs_is_idempotent():
    # `make -q` exits 0 only when every target is up to date: a second run would do nothing.
    assert subprocess.run(["make", "-q", "venvs"], cwd=ROOT).returncode == 0


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^\s*(make \w+)\s*$", readme, flags=re.M)
    assert "make test" in commands and "make demo" in commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M)
