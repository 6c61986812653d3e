"""The trainer's own rollout worker failing under it, as processes: `trainer-svc train` spawns
its worker (here the echo engine, so that no engine start is paid: what is tried is the
processes' lifecycle, not generation) and

- the worker SIGKILLed mid-run: the trainer exits 69 naming the worker's log; the relaunch
  resumes from the newest checkpoint and finishes;
- the worker frozen (SIGSTOP): its heartbeat stands still, the trainer exits 69 saying so, and
  leaves no process behind (the frozen worker is stopped);
- the trainer SIGKILLed: its worker lives on (its own session, until its idle exit); the
  relaunch stops that worker before it spawns its own, so two engines never share a device.

Outcomes are asserted, not durations; the seconds each exit took are printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import poll
from run_config import ROLLOUT_VENV, SMALL_STEPS, write_run_config

from protocol import exit_codes
from protocol.messages import WorkerStatus
from protocol.spool import Spool

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / ".venvs" / "trainer" / "bin" / "trainer-svc"
STEPS = 30
LEASE = ["--lease", "3", "--heartbeat", "1"]  # a frozen worker shows within seconds


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spawned") / "tiny"
    subprocess.run([str(ROOT / ".venvs/rollout/bin/rollout-svc"), "tiny-model", str(path)], check=True)
    return path


def config(run_dir: Path, model: Path) -> Path:
    """SMALL_STEPS with a spawned echo worker and a checkpoint every step, written beside `run_dir`."""
    ours = {
        "run": {"dir": run_dir, "seed": 5},
        "model": {"path": model},
        "rollout": {"rollout_venv": ROLLOUT_VENV, "worker_args": ["--engine", "echo", *LEASE], "no_worker_grace_s": 30},
        "train": {"steps": STEPS},
        "checkpoint": {"every": 1, "keep_last": 2},
    }
    return write_run_config(run_dir.with_suffix(".toml"), SMALL_STEPS, ours)


def launch(cfg: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(TRAINER), "train", str(cfg)], stdout=open(cfg.with_suffix(".log"), "ab"), stderr=subprocess.STDOUT,
        cwd=ROOT, start_new_session=True,
    )  # fmt: skip


def output(cfg: Path) -> str:
    return cfg.with_suffix(".log").read_text()


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def running(run_dir: Path, cfg: Path) -> tuple[subprocess.Popen, WorkerStatus]:
    """A trainer that has taken two steps, and its spawned worker's status."""
    proc = launch(cfg)
    seen = poll(lambda: len(rows(run_dir)), lambda n: n >= 2 or proc.poll() is not None, timeout_s=300)
    assert proc.poll() is None and seen >= 2, output(cfg)[-3000:]
    statuses = [s for _, s in Spool(run_dir / "spool").statuses() if s is not None]
    assert len(statuses) == 1 and statuses[0].worker_id.endswith("-rollout")
    return proc, statuses[0]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def finish(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def signal_worker_and_expect_69(proc: subprocess.Popen, worker_pid: int, cfg: Path, sig: int, what: str) -> None:
    """Send `sig` to the worker; the trainer must exit 69 (rollout unavailable). Prints how long it took."""
    try:
        sent_at = time.monotonic()
        os.kill(worker_pid, sig)
        assert proc.wait(timeout=300) == exit_codes.ROLLOUT_UNAVAILABLE, output(cfg)[-3000:]
        print(f"\nexit 69 {time.monotonic() - sent_at:.1f} s after {what}")
    finally:
        finish(proc)


def test_a_killed_worker_ends_the_run_with_69_and_the_relaunch_resumes(model, tmp_path):
    run_dir = tmp_path / "killed"
    cfg = config(run_dir, model)
    proc, worker = running(run_dir, cfg)
    signal_worker_and_expect_69(proc, worker.pid, cfg, signal.SIGKILL, "the worker's SIGKILL")
    assert "the rollout worker exited with code -9" in output(cfg) and "rollout-worker.log" in output(cfg)
    done = len(rows(run_dir))
    relaunch = launch(cfg)
    try:
        assert relaunch.wait(timeout=300) == exit_codes.OK, output(cfg)[-3000:]
    finally:
        finish(relaunch)
    steps = [row["step"] for row in rows(run_dir)]
    assert steps[-1] == steps[0] + STEPS - 1  # finished
    assert steps[done] > steps[0]  # resumed from a checkpoint, not from the start


def test_a_frozen_worker_ends_the_run_with_69_and_is_stopped(model, tmp_path):
    run_dir = tmp_path / "frozen"
    cfg = config(run_dir, model)
    proc, worker = running(run_dir, cfg)
    try:
        signal_worker_and_expect_69(proc, worker.pid, cfg, signal.SIGSTOP, "the worker froze (lease 3 s)")
    finally:
        if alive(worker.pid):
            os.kill(worker.pid, signal.SIGCONT)
    assert "heartbeat stood still" in output(cfg) and "rollout-worker.log" in output(cfg)
    assert not alive(worker.pid), "the frozen worker was left behind"


def test_a_relaunch_stops_the_worker_its_killed_predecessor_left(model, tmp_path):
    run_dir = tmp_path / "orphan"
    cfg = config(run_dir, model)
    proc, orphan = running(run_dir, cfg)
    os.kill(proc.pid, signal.SIGKILL)  # the trainer alone: its worker leads a session of its own
    proc.wait(timeout=60)
    assert alive(orphan.pid), "the worker should outlive a SIGKILLed trainer (until its idle exit)"
    relaunch = launch(cfg)
    try:
        assert relaunch.wait(timeout=300) == exit_codes.OK, output(cfg)[-3000:]
    finally:
        finish(relaunch)
        if alive(orphan.pid):
            os.kill(orphan.pid, signal.SIGKILL)
    assert f"left running (pid {orphan.pid}" in output(cfg)
    assert not alive(orphan.pid)
    steps = [row["step"] for row in rows(run_dir)]
    assert steps[-1] == steps[0] + STEPS - 1
