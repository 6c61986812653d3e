"""Real echo workers for trainer tests that go through the spool: `rollout-svc serve --engine
echo` processes (no model: the spool mechanics alone)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import ROLLOUT_SVC

from protocol.spool import Spool


class EchoWorkers:
    """`rollout-svc serve --engine echo` processes, each in its own session, all ended at teardown."""

    def __init__(self, spool_dir: Path, log_dir: Path):
        self.spool_dir, self.log_dir = spool_dir, log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, worker_id: str, *args: str) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{worker_id}.log", "ab") as log:
            proc = subprocess.Popen(
                [str(ROLLOUT_SVC), "serve", "--engine", "echo", "--spool", str(self.spool_dir)]
                + ["--worker-id", worker_id, "--idle-exit", "0", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[worker_id] = proc
        spool, deadline = Spool(self.spool_dir, create=True), time.monotonic() + 60
        while not any(s.worker_id == worker_id and s.pid == proc.pid for s in spool.live_workers()):
            assert proc.poll() is None and time.monotonic() < deadline, f"echo worker {worker_id} did not start"
            time.sleep(0.1)
        return proc

    def stop(self, worker_id: str) -> None:
        proc = self.procs.pop(worker_id)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)

    def close(self) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
