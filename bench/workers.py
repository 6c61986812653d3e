"""Rollout workers as the benchmarks run them: real `rollout-svc serve` processes, each in its own
process group, always stopped at the end (SIGTERM, then SIGKILL).

Nothing here imports an engine: a worker is a process of the rollout venv's `rollout-svc`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from protocol.spool import Spool

from .common import ROLLOUT_VENV

BIN = Path(sys.executable).parent


def rollout_svc() -> list[str]:
    """`rollout-svc` beside this interpreter, else the rollout venv's, else the module."""
    for candidate in (BIN / "rollout-svc", ROLLOUT_VENV / "bin" / "rollout-svc"):
        if candidate.exists():
            return [str(candidate)]
    return [sys.executable, "-c", "from rollout_svc.cli import main; main()"]


def start_worker(
    spool: Spool, worker_id: str, args: list[str], log_dir: Path, env=None, command: list[str] | None = None
) -> subprocess.Popen:
    """One `rollout-svc serve` (`command`, by default rollout_svc()) on `spool`, its output
    appended to log_dir/<worker_id>.log."""
    with open(log_dir / f"{worker_id}.log", "ab") as log:
        return subprocess.Popen(
            [*(command or rollout_svc()), "serve", "--spool", str(spool.root), "--worker-id", worker_id, *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )


def wait_until(spool: Spool, worker_id: str, predicate, timeout_s: float = 600) -> None:
    """Until the status of `worker_id` satisfies `predicate`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(s is not None and s.worker_id == worker_id and predicate(s) for _, s in spool.statuses()):
            return
        time.sleep(0.2)
    raise TimeoutError(f"worker {worker_id} not ready after {timeout_s} s")


def serving(status) -> bool:
    """Idle with its weights loaded; the echo engine, which loads none, as soon as it is idle."""
    return status.state == "idle" and bool(status.weights_dir or status.engine.startswith("echo"))


def stop(proc: subprocess.Popen, grace_s: float = 90) -> None:
    """SIGTERM, up to `grace_s` to finish, then SIGKILL to whatever is left of its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class EchoWorkers:
    """`count` echo workers (`--engine echo`) serving one spool, ids `<prefix>-<i>`; a context
    manager that waits for each one's status file and always stops them."""

    def __init__(
        self, spool: Spool, count: int, log_dir: Path, prefix: str = "echo", extra=(), command: list[str] | None = None
    ):
        self.spool, self.count, self.log_dir, self.prefix = spool, count, log_dir, prefix
        self.extra, self.command = list(extra), command
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> EchoWorkers:
        ids = [f"{self.prefix}-{i}" for i in range(self.count)]
        args = ["--engine", "echo", "--idle-exit", "0", "--log-level", "WARNING", *self.extra]
        self.procs = [start_worker(self.spool, w, args, self.log_dir, command=self.command) for w in ids]
        deadline = time.monotonic() + 60
        while not all((self.spool.workers / f"{w}.json").exists() for w in ids):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.__exit__()
                raise SystemExit(f"echo workers did not start; see {self.log_dir}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            stop(proc, grace_s=15)
