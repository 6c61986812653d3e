"""Shared fixtures of the unit tier: a spool in tmp_path, request builders, in-process workers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from protocol.messages import Request
from protocol.spool import MAX_REQUEST_BYTES, Spool

settings.register_profile(
    "unit",
    max_examples=60,
    deadline=2000,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("unit")

TESTS = Path(__file__).resolve().parent.parent
CORPUS = TESTS / "corpus"
if str(TESTS) not in sys.path:
    sys.path.append(str(TESTS))  # helpers shared with the other tiers (torn_reads)


def _make_request(request_id: str = "req-1", **fields) -> Request:
    values = dict(
        request_id=request_id,
        weights_dir="/models/echo",
        prompts=["hello world"],
        n_samples_per_prompt=2,
        max_tokens=5,
        temperature=0.7,
    )
    values.update(fields)
    return Request(**values)


def _wait_for(predicate, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """Poll `predicate` until it returns something truthy; fail the test after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


@pytest.fixture
def spool(tmp_path) -> Spool:
    return Spool(tmp_path / "spool", create=True)


@pytest.fixture
def make_request():
    """Build a valid Request; keyword arguments override fields."""
    return _make_request


@pytest.fixture
def wait_for():
    return _wait_for


class BadInputCorpus:
    """The bad request files of tests/corpus plus the cases no plain file can hold.

    `cases` maps a case name to {"request_file", "code", "mentions"}: the name the case needs in
    requests/, the error code it must get, and a piece of text the error message must contain.
    """

    # Entries that cannot be stored in git as request files; created in requests/ at run time.
    RUNTIME = {
        "symlink": {"request_file": "symlink.json", "code": "not_a_file", "mentions": "symlink"},
        "dangling_symlink": {"request_file": "dangling_symlink.json", "code": "not_a_file", "mentions": "symlink"},
        "directory": {"request_file": "directory.json", "code": "not_a_file", "mentions": "a directory"},
        "fifo": {"request_file": "fifo.json", "code": "not_a_file", "mentions": "not a regular file"},
        "huge": {"request_file": "huge.json", "code": "too_large", "mentions": f"more than the {MAX_REQUEST_BYTES}"},
    }

    def __init__(self, directory: Path, scratch: Path):
        self.directory = directory
        self.scratch = scratch  # where a symlink's target lives, outside the spool
        self.files = json.loads((directory / "expected.json").read_text())
        self.cases = {**self.files, **self.RUNTIME}

    def place(self, spool: Spool, case: str) -> Path:
        """Create `case` in spool.requests/ under the name it needs; returns its path."""
        spec = self.cases[case]
        path = spool.requests / spec["request_file"]
        if case in self.files:
            shutil.copyfile(self.directory / case, path)
        elif case == "symlink":
            target = self.scratch / "symlink-target.json"
            target.write_bytes(encode_valid("symlink"))
            os.symlink(target, path)
        elif case == "dangling_symlink":
            os.symlink(self.scratch / "does-not-exist.json", path)
        elif case == "directory":
            path.mkdir()
            (path / "inside.json").write_bytes(encode_valid("directory"))
        elif case == "fifo":
            os.mkfifo(path)
        elif case == "huge":
            with open(path, "wb") as f:  # sparse: costs no disk and no write time
                f.write(encode_valid("huge")[:-1])
                f.truncate(MAX_REQUEST_BYTES + 1)
        else:
            raise KeyError(case)
        return path

    def place_all(self, spool: Spool) -> dict[str, Path]:
        return {case: self.place(spool, case) for case in self.cases}


def encode_valid(request_id: str) -> bytes:
    from protocol.messages import encode

    return encode(_make_request(request_id))


@pytest.fixture
def corpus(tmp_path) -> BadInputCorpus:
    scratch = tmp_path / "outside-spool"
    scratch.mkdir(exist_ok=True)
    return BadInputCorpus(CORPUS, scratch)


class _ThreadSafeSignal(types.ModuleType):
    """The signal module as a worker in a thread may use it: handlers and alarms are process-wide
    and belong to the main thread (the test runner's timeout uses SIGALRM), so both are no-ops."""

    def __init__(self):
        super().__init__("signal")
        self.handlers: dict = {}
        self.alarms: list = []

    def __getattr__(self, name):
        return getattr(signal, name)

    def signal(self, signum, handler):
        self.handlers[signum] = handler

    def alarm(self, seconds):
        self.alarms.append(seconds)
        return 0


class WorkerThread:
    """A rollout Worker serving a spool in a background thread.

    Worker.serve installs SIGTERM/SIGINT handlers, which Python allows only in the main thread;
    here the worker module sees a stand-in signal module, and stop() plays the signal's part.
    """

    def __init__(self, worker):
        self.worker = worker
        self.rc: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"worker-{worker.config.worker_id}", daemon=True)

    def _run(self) -> None:
        try:
            self.rc = self.worker.serve()
        except BaseException as exc:  # reported by join()
            self.error = exc

    def start(self) -> WorkerThread:
        self.thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> int | None:
        self.worker.request_stop()
        return self.join(timeout)

    def join(self, timeout: float = 10.0) -> int | None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.worker.request_stop()
            self.thread.join(5)
            pytest.fail(f"worker {self.worker.config.worker_id} did not exit within {timeout} s")
        return self.rc

    @property
    def counters(self):
        return self.worker.heartbeat.status.counters


@pytest.fixture
def run_worker(monkeypatch):
    """Start a Worker in a thread: run_worker(spool, engine=None, **WorkerConfig fields).

    Defaults suit tests: short rescans and heartbeats, no idle exit. Every worker still running
    at the end of the test is stopped."""
    import rollout_svc.worker as worker_module
    from rollout_svc.engines.echo import EchoEngine
    from rollout_svc.worker import Worker, WorkerConfig

    monkeypatch.setattr(worker_module, "signal", _ThreadSafeSignal())
    started: list[WorkerThread] = []

    def start(spool: Spool, engine=None, **config) -> WorkerThread:
        options = dict(worker_id="w1", lease_s=3.0, heartbeat_s=0.2, idle_exit_s=None, rescan_s=0.1)
        options.update(config)
        handle = WorkerThread(Worker(spool, engine or EchoEngine(), WorkerConfig(**options)))
        started.append(handle.start())
        return handle

    yield start
    for handle in started:
        if handle.thread.is_alive():
            handle.worker.request_stop()
            handle.thread.join(10)


@pytest.fixture(scope="session")
def storages(tmp_path_factory):
    """Filesystems a spool can live on (tests/netfs.py): mounted at first use, unmounted at the end."""
    from netfs import Storages

    storages = Storages(tmp_path_factory.mktemp("storages"))
    yield storages
    storages.close()
