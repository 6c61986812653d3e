"""The GPU tier's place in the suite: `pytest tests` never collects tests/gpu, and a run of
tests/gpu where no CUDA GPU is visible fails with a message saying so (it does not skip)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def pytest_run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU, whatever this machine has
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip


def test_the_cpu_suite_does_not_collect_the_gpu_tier():
    run = pytest_run("tests", "--ignore=tests/trainer", "--collect-only", "-q")
    assert run.returncode == 0, run.stdout + run.stderr
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    assert any(line.startswith("tests/unit/") for line in collected)
    assert not any(line.startswith("tests/gpu/") for line in collected)


def test_the_gpu_tier_fails_where_no_gpu_is_visible():
    run = pytest_run("tests/gpu", "-q")
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr
    assert "tests/gpu needs a CUDA GPU and none is visible" in run.stderr
    assert "passed" not in run.stdout and "skipped" not in run.stdout
