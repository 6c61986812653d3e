"""`prefer_worker` with two real echo workers through the real spool: a live preferred worker gets
its requests; a dead or absent one's are served by the other at once; a frozen one's are taken
by the other once `--sticky-wait-s` is over, never starved.

"At once" is shown without timing it: the sticky wait there is far longer than the test's own
timeout, so a worker that waited for a dead peer would fail the test."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import kill_session, start_worker, wait_for_status

from protocol.client import SpoolClient
from protocol.messages import Request
from protocol.spool import Spool

pytestmark = pytest.mark.timeout(300)

FOREVER_S = "3600"  # a sticky wait no test outlasts


@pytest.fixture
def workers(tmp_path):
    spool = Spool(tmp_path / "spool", create=True)
    procs = {}

    def start(worker_id: str, *args: str):
        proc = start_worker(spool.root, worker_id, "--engine", "echo", "--idle-exit", "0", *args, log_dir=tmp_path)
        procs[worker_id] = proc
        wait_for_status(spool, worker_id, lambda s: s.pid == proc.pid and s.state == "idle", 60, proc)
        return proc

    start.spool = spool
    yield start
    for proc in procs.values():
        try:
            os.killpg(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        kill_session(proc)
        proc.wait(timeout=30)


def request(request_id: str, prefer: str | None) -> Request:
    return Request(
        request_id=request_id, weights_dir="/models/none", prompts=[request_id], n_samples_per_prompt=1,
        max_tokens=8, temperature=1.0, prefer_worker=prefer,
    )  # fmt: skip


def served(spool: Spool, requests: list[Request]) -> dict:
    with SpoolClient(spool.root, no_worker_grace_s=60) as client:
        results = client.wait([r.request_id for r in requests], timeout_s=120)
    assert all(r.ok for r in results.values()), [r.error for r in results.values()]
    return results


def test_a_live_preferred_worker_gets_its_requests(workers):
    workers("echo-a", "--sticky-wait-s", FOREVER_S)
    workers("echo-b", "--sticky-wait-s", FOREVER_S)
    spool = workers.spool
    asked = [request(f"r{i}", "echo-a" if i % 2 else "echo-b") for i in range(20)]
    spool.submit_many(asked)
    results = served(spool, asked)
    assert {request_id: result.worker_id for request_id, result in results.items()} == {
        r.request_id: r.prefer_worker for r in asked
    }


def test_a_dead_or_absent_preferred_workers_requests_are_served_by_the_other_at_once(workers):
    dead = workers("echo-dead", "--lease", "3", "--heartbeat", "0.5")
    kill_session(dead)  # SIGKILLed: its status file stays, and goes stale
    dead.wait(timeout=30)
    workers("echo-b", "--sticky-wait-s", FOREVER_S)
    spool = workers.spool
    assert spool.status_path("echo-dead").exists()
    asked = [request("to-dead", "echo-dead"), request("to-nobody", "echo-never-started")]
    spool.submit_many(asked)
    assert {result.worker_id for result in served(spool, asked).values()} == {"echo-b"}


def test_a_frozen_preferred_workers_request_is_taken_by_the_other_after_the_sticky_wait(workers):
    frozen = workers("echo-a", "--lease", "120")  # live by its status for the whole test
    workers("echo-b", "--sticky-wait-s", "1")
    os.killpg(frozen.pid, signal.SIGSTOP)
    spool = workers.spool
    theirs, anyone = request("theirs", "echo-a"), request("anyone", None)
    spool.submit(theirs)
    spool.submit(anyone)  # newer, but not left to a peer: served first
    results = served(spool, [theirs, anyone])
    assert {r.worker_id for r in results.values()} == {"echo-b"}
    assert results["theirs"].finished_at > results["anyone"].finished_at
    assert results["theirs"].texts == [["theirs"]]
