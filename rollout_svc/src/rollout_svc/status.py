"""The worker's status file, the heartbeat thread that keeps it fresh, and the worker's counts.

The status file is the lease: other processes give this worker's claims back to requests/ once
it has not changed for `lease_s` as they watch it (protocol/leases.py). The heartbeat runs in
its own thread so a long engine call does not starve it; if writing fails, `alive()` turns false
and the worker loop stops publishing (a worker without a heartbeat may already have lost its
claims); `failure` says why (a full disk, or something else).

The worker counts in two places and nowhere else: the status file's `counters` (requests,
samples, tokens) and a `Tally` of what the status file does not show (errors by code, reloads,
the last engine call's rate, the queue depth, sleeps and wakes). The metrics textfile renders both.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.messages import WorkerCounters, WorkerState, WorkerStatus
from protocol.spool import Spool

log = logging.getLogger(__name__)


@dataclass
class Tally:
    """The worker's figures beyond the status file's counters, kept for the metrics textfile."""

    errors: Counter[str] = field(default_factory=Counter)  # error results by code (sum: requests_failed)
    reloads: int = 0  # engine calls that loaded weights (a reload in place or an engine build)
    reload_s: float = 0.0  # seconds of the last such load
    reloading_seconds: float = 0.0  # seconds of all such loads
    tokens_per_s: float = 0.0  # generated tokens per second of generation in the last engine call (its load excluded)
    generation_seconds: float = 0.0  # seconds the engine spent generating, loads excluded, all calls
    queue_depth: int = 0  # requests waiting in requests/ at the last scan
    asleep: bool = False  # the engine sleeps: its device memory is free
    sleeps: int = 0  # times the engine was put to sleep
    sleep_s: float = 0.0  # seconds the last fall asleep took
    wakes: int = 0  # times a request woke the engine
    wake_s: float = 0.0  # seconds the last wake took, weights reloaded included


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
            raise ValueError(
                f"heartbeat interval {interval_s} s must be at most a third of the lease {lease_s} s; "
                "lower heartbeat_s (--heartbeat) or raise lease_s (--lease)"
            )
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
        self.failure: OSError | None = None  # why the last write failed; None after a success
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def stop(self, *, remove: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)
        if remove:
            try:
                self.spool.remove_status(self.status.worker_id)
            except OSError as exc:  # at exit: the exit code and the log already say what failed
                log.error("status file not removed: %s", exc)

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
                self.failure = exc
                log.error("heartbeat write failed: %s", exc)
                return False
            self.failure = None
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
