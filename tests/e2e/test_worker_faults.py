"""Faults a rollout worker meets, each tried on a real `rollout-svc serve` process.

- Stop paths: SIGTERM while a batch outlasts `--stop-grace` gives the batch back (its request
  returns to requests/ and another worker serves it); a second signal gives it back at once.
  The batch is made to outlast any grace by freezing the worker's engine processes (SIGSTOP,
  as a hung device would): the worker's own process, its signal handlers and its heartbeat keep
  running, and the outcome does not depend on how fast this machine generates.
- Polling: a worker started with `--poll`, and one in a user namespace whose inotify instance
  limit is 0 (watchdog cannot open inotify there, as on a host out of inotify instances), find
  requests by their rescans and serve them.
- A full disk (a file-size limit on the worker, RLIMIT_FSIZE; Python ignores SIGXFSZ, so writes
  fail with EFBIG): a result or a status file that cannot be written sends its request back to
  requests/ and the worker exits 74 with a message naming the file; a status file that cannot be
  written for another reason (its name taken by a directory) exits 1. Nothing half written is
  left, and another worker serves the request. tests/e2e/test_worker_full_disk.py fills a real
  filesystem instead.

The echo engine serves where vLLM is not the point; the stop paths use vLLM (an engine process
to freeze), one engine start per test, since each test ends its worker.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BIN, ServedWorker, keep_running, poll, start_worker, stop_worker, wait_for_status

from protocol import exit_codes
from protocol.messages import Request
from protocol.spool import Spool

pytestmark = pytest.mark.timeout(600)

ECHO = ("--engine", "echo", "--idle-exit", "0")
# A user namespace in which no inotify instance may be opened; the command runs inside it.
NO_INOTIFY = (
    "unshare", "--user", "--map-root-user", "sh", "-c",
    'echo 0 > /proc/sys/user/max_inotify_instances && exec "$@"', "no-inotify",
)  # fmt: skip


def echo_request(request_id: str, prompt: str = "hello", max_tokens: int = 8) -> Request:
    return Request(
        request_id=request_id, weights_dir="/models/any", prompts=[prompt], n_samples_per_prompt=1,
        max_tokens=max_tokens, temperature=0.0,
    )  # fmt: skip


def log_of(log_dir: Path, worker_id: str) -> str:
    return (log_dir / f"{worker_id}.log").read_text(errors="replace")


def serve_command(spool: Spool, worker_id: str, *args: str) -> list[str]:
    return [str(BIN / "rollout-svc"), "serve", "--spool", str(spool.root), "--worker-id", worker_id, *args]


# -- polling ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("events", ["--poll", "no inotify"])
def test_a_worker_without_file_events_serves_by_rescanning(tmp_path, client_for, events):
    spool = Spool(tmp_path / "spool", create=True)
    if events == "--poll":
        proc = start_worker(spool.root, "poller", "--poll", *ECHO, log_dir=tmp_path)
    else:
        log = open(tmp_path / "poller.log", "ab")
        command = [*NO_INOTIFY, *serve_command(spool, "poller", *ECHO)]
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        client = client_for(spool.root)
        for i in range(3):  # one at a time: each is found by a rescan, not by a hint left by the last
            rid = f"polled-{i}"
            client.submit(echo_request(rid, prompt=f"prompt {i}"))
            result = client.wait([rid], timeout_s=60)[rid]
            assert result.ok and result.texts == [[f"prompt {i}"[:8]]] and result.worker_id == "poller"
        log = log_of(tmp_path, "poller")
        assert "new requests found by polling" in log
        if events == "no inotify":
            assert "file events unavailable" in log and "inotify instance limit reached" in log
        assert stop_worker(proc) == exit_codes.OK
    finally:
        stop_worker(proc)


# -- a full disk -----------------------------------------------------------------------------------


def limited_worker(spool: Spool, worker_id: str, file_size_limit: int) -> subprocess.Popen:
    """An echo worker whose files may not grow past `file_size_limit` bytes. Its output goes to
    a pipe (a log file would be limited too)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.Popen(
        serve_command(spool, worker_id, *ECHO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        preexec_fn=limit, start_new_session=True, text=True,
    )  # fmt: skip


def nothing_half_written(spool: Spool) -> None:
    assert os.listdir(spool.tmp) == [] and os.listdir(spool.claimed) == []
    assert os.listdir(spool.workers) == []  # the status file is removed at exit, never left partial


def test_a_result_the_disk_cannot_hold_goes_back_to_requests(tmp_path, client_for):
    spool = Spool(tmp_path / "spool", create=True)
    client = client_for(spool.root)
    proc = limited_worker(spool, "cramped", file_size_limit=16 * 1024)
    try:
        client.submit(echo_request("small"))
        assert client.wait(["small"], timeout_s=60)["small"].ok  # small files still fit
        big_prompt = "x" * 20_000  # its result holds 20,000 token ids: far past 16 KiB
        client.submit(echo_request("big", prompt=big_prompt, max_tokens=20_000))
        output, _ = proc.communicate(timeout=60)
    finally:
        stop_worker(proc)
    assert proc.returncode == exit_codes.CANNOT_WRITE, output[-3000:]
    assert f"cannot write to the spool {spool.root}" in output and "File too large" in output
    assert "gave back 1 requests" in output and "Free space" in output
    assert spool.request_path("big").exists() and not spool.has_result("big")
    assert (spool.done / "small.request.json").exists()
    nothing_half_written(spool)

    other = start_worker(spool.root, "roomy", *ECHO, log_dir=tmp_path)
    try:
        result = client.wait(["big"], timeout_s=60)["big"]
        assert result.ok and result.worker_id == "roomy" and result.texts == [[big_prompt]]
    finally:
        stop_worker(other)


def test_a_status_file_the_disk_cannot_hold_stops_the_worker_before_it_claims(tmp_path, client_for):
    spool = Spool(tmp_path / "spool", create=True)
    client = client_for(spool.root)
    client.submit(echo_request("waiting"))
    proc = limited_worker(spool, "cramped", file_size_limit=64)  # a status file is larger
    try:
        output, _ = proc.communicate(timeout=60)
    finally:
        stop_worker(proc)
    assert proc.returncode == exit_codes.CANNOT_WRITE, output[-3000:]
    assert "heartbeat write failed" in output and "File too large" in output
    assert f"-> '{spool.status_path('cramped')}'" in output and "Free space" in output
    assert spool.request_path("waiting").exists()
    nothing_half_written(spool)

    other = start_worker(spool.root, "roomy", *ECHO, log_dir=tmp_path)
    try:
        assert client.wait(["waiting"], timeout_s=60)["waiting"].worker_id == "roomy"
    finally:
        stop_worker(other)


def test_a_status_file_that_cannot_be_written_for_another_reason_exits_1(tmp_path, client_for):
    spool = Spool(tmp_path / "spool", create=True)
    client_for(spool.root).submit(echo_request("waiting"))
    spool.status_path("blocked").mkdir()  # its status file's name is taken by a directory: rename() fails, EISDIR
    proc = start_worker(spool.root, "blocked", *ECHO, log_dir=tmp_path)
    try:
        assert proc.wait(timeout=60) == exit_codes.INTERNAL_ERROR, log_of(tmp_path, "blocked")[-3000:]
    finally:
        stop_worker(proc)
    log = log_of(tmp_path, "blocked")
    assert "heartbeat write failed" in log and "Is a directory" in log and "heartbeat lost" in log
    assert "Traceback" not in log
    assert spool.request_path("waiting").exists() and os.listdir(spool.claimed) == []


# -- stop paths ------------------------------------------------------------------------------------


def session_members(session_id: int) -> list[int]:
    """Pids of the processes in a session (from /proc/<pid>/stat: state ppid pgrp session ...)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[3]) == session_id:
            members.append(int(entry))
    return members


def freeze_engine(worker: subprocess.Popen) -> None:
    """SIGSTOP the worker's engine processes (they share its session), not the worker."""
    engine = [pid for pid in session_members(worker.pid) if pid != worker.pid]
    assert engine, "the worker has no engine process to freeze"
    for pid in engine:
        os.kill(pid, signal.SIGSTOP)


@pytest.fixture
def stuck_batch(models, tmp_path, client_for):
    """`start(grace)`: a vLLM worker with `--stop-grace grace`, busy with a request whose engine
    call cannot finish; returns (spool, worker, request id). The worker is killed at the end."""
    spool = Spool(tmp_path / "spool", create=True)
    started: list[ServedWorker] = []

    def start(grace: float):
        args = [
            "--engine", "vllm", "--allowed-root", str(models["root"]), "--weights", str(models["a"]),
            "--max-model-len", "64", "--idle-exit", "0", "--stop-grace", str(grace),
        ]  # fmt: skip
        worker = ServedWorker(spool, "stuck", args, log_dir=tmp_path)
        started.append(worker)
        keep_running(worker)
        freeze_engine(worker.proc)
        rid = f"stuck-{time.time_ns()}"
        client_for(spool.root).submit(
            Request(request_id=rid, weights_dir=str(models["a"]), prompts=["1+1="], n_samples_per_prompt=2,
                    max_tokens=8, temperature=1.0, seed=3)
        )  # fmt: skip
        wait_for_status(spool, "stuck", lambda s: s.state == "generating" and s.current_request == rid, 60, worker.proc)
        return spool, worker, rid

    yield start
    for worker in started:
        worker.kill()


def served_elsewhere(spool: Spool, rid: str, tmp_path: Path, client) -> None:
    """The given-back request is whole in requests/, and another worker serves it."""
    assert spool.request_path(rid).exists() and not spool.has_result(rid)
    assert os.listdir(spool.claimed) == [] and not spool.status_path("stuck").exists()
    other = start_worker(spool.root, "other", *ECHO, log_dir=tmp_path)
    try:
        result = client.wait([rid], timeout_s=60)[rid]
        assert result.ok and result.worker_id == "other"
    finally:
        stop_worker(other)


def test_sigterm_gives_back_a_batch_that_outlasts_the_stop_grace(stuck_batch, tmp_path, client_for):
    spool, worker, rid = stuck_batch(grace=1)
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(timeout=180) == exit_codes.OK
    log = log_of(tmp_path, "stuck")
    assert "has 1 s (--stop-grace) to finish" in log and "stop grace over; giving back 1 requests" in log
    served_elsewhere(spool, rid, tmp_path, client_for(spool.root))


def test_a_second_signal_gives_the_batch_back_at_once(stuck_batch, tmp_path, client_for):
    spool, worker, rid = stuck_batch(grace=3600)  # the first signal alone would wait an hour
    worker.proc.send_signal(signal.SIGTERM)
    poll(lambda: log_of(tmp_path, "stuck"), lambda log: "(--stop-grace) to finish" in log)
    assert worker.proc.poll() is None  # still within the grace
    worker.proc.send_signal(signal.SIGINT)
    assert worker.proc.wait(timeout=180) == exit_codes.OK  # far sooner than the hour
    assert "stop grace over; giving back 1 requests" in log_of(tmp_path, "stuck")
    served_elsewhere(spool, rid, tmp_path, client_for(spool.root))
