"""The worker's status file and the heartbeat thread that keeps it fresh.

The status file's mtime is the lease: other processes give this worker's claims back to
requests/ once it is older than `lease_s`. The heartbeat runs in its own thread so a long
engine call does not starve it; if writing fails, `alive()` turns false and the worker loop
stops publishing (a worker without a heartbeat may already have lost its claims).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

from protocol.messages import WorkerCounters, WorkerState, WorkerStatus
from protocol.spool import Spool

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(
        self,
        spool: Spool,
        *,
        worker_id: str,
        engine: str,
        device: str,
        lease_s: float,
        interval_s: float,
        on_beat: Callable[[], None] = lambda: None,
    ):
        if interval_s * 3 > lease_s:
            raise ValueError(f"heartbeat interval {interval_s} s must be at most a third of the lease {lease_s} s")
        self.spool = spool
        self.lease_s = lease_s
        self.interval_s = interval_s
        self.on_beat = on_beat  # called after each successful beat (systemd's watchdog)
        now = time.time()
        self.status = WorkerStatus(
            worker_id=worker_id,
            pid=os.getpid(),
            host=socket.gethostname(),
            device=device,
            engine=engine,
            state="starting",
            lease_s=lease_s,
            started_at=now,
            heartbeat_at=now,
            counters=WorkerCounters(),
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last_beat = 0.0  # monotonic time of the last successful write
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def stop(self, *, remove: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)
        if remove:
            self.spool.remove_status(self.status.worker_id)

    def update(self, **fields) -> None:
        """Change status fields and publish at once, so operators see state changes live."""
        with self._lock:
            for name, value in fields.items():
                setattr(self.status, name, value)
        self.beat()

    def count(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self.status.counters, name, getattr(self.status.counters, name) + value)

    def set_state(self, state: WorkerState, current_request: str | None = None) -> None:
        self.update(state=state, current_request=current_request)

    def beat(self) -> bool:
        with self._lock:
            self.status.heartbeat_at = time.time()
            try:
                self.spool.write_status(self.status)
            except OSError as exc:
                log.error("heartbeat write failed: %s", exc)
                return False
            self._last_beat = time.monotonic()
        self.on_beat()
        return True

    def alive(self) -> bool:
        """True while the last successful beat is recent enough that our claims are safe.

        Half the lease leaves a margin for the time between this check and a publish."""
        return self._thread.is_alive() and time.monotonic() - self._last_beat < self.lease_s / 2

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()
