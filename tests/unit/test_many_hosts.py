"""The spool shared by several hosts: caches that hide new names, link() that reports a failure
after succeeding, and clocks that disagree.

Two sshfs mounts of one directory (tests/netfs.py) stand for two hosts: each has its own caches
of attributes, listings and absent names, so what one writes the other sees only as a network
filesystem client would. Where /dev/fuse or the tools are missing these tests fail, naming them.
"""

from __future__ import annotations

import os
import time

import pytest
from netfs import NEGATIVE_CACHE_S

from protocol import fsio
from protocol.client import NoLiveWorker, ResultTimeout, SpoolClient
from protocol.messages import ErrorCode, Result, WorkerStatus
from protocol.spool import RequestExists, Spool

pytestmark = pytest.mark.timeout(120)

LEASE_S = 30.0
HOURS = 3 * 3600.0


@pytest.fixture
def two_hosts(storages, tmp_path) -> tuple[Spool, Spool]:
    """One spool seen from two hosts: host A's mount and host B's mount of the same directory."""
    on_a = storages.root("sshfs", tmp_path.name, tmp_path)
    on_b = storages.second_host() / tmp_path.name
    return Spool(on_a, create=True), Spool(on_b)


def test_mount_tests_refuse_loudly_where_fuse_or_a_tool_is_missing(monkeypatch):
    import netfs

    real_exists = os.path.exists
    monkeypatch.setattr(netfs.os.path, "exists", lambda p: p != "/dev/fuse" and real_exists(p))
    monkeypatch.setattr(netfs.shutil, "which", lambda tool: None if tool == "bindfs" else f"/usr/bin/{tool}")
    with pytest.raises(pytest.fail.Exception) as info:
        netfs.require("bindfs")
    message = str(info.value)
    assert "cannot mount bindfs" in message and "/dev/fuse" in message and "bindfs" in message
    assert "apt-get install -y sshfs openssh-server bindfs" in message


# -- lookups that no negative cache can stall ------------------------------------------------------


def test_host_b_does_not_see_by_name_what_host_a_created_after_b_looked(two_hosts, wait_for):
    """The trap the spool avoids, armed here: host B looks up a name while it is absent, host A
    creates it, B's listing shows it, and B's lookup by name still says it is not there."""
    a, b = two_hosts
    assert not os.path.exists(b.results / "probe.json")
    (a.results / "probe.json").write_bytes(b"{}")
    wait_for(lambda: "probe.json" in os.listdir(b.results), what="host B's listing to show the new file")
    assert not os.path.exists(b.results / "probe.json")  # negative_timeout is NEGATIVE_CACHE_S


def test_a_producer_on_one_host_is_served_by_a_worker_on_another(two_hosts, make_request, run_worker, wait_for):
    """The producer (host B) submits and waits before any worker runs, then a worker on host A
    serves it, and a second request sent while that worker waits for work: B finds the results
    from listings, A the requests. A lookup by name of the result made while it
    was absent would hide it for NEGATIVE_CACHE_S, far past this wait's deadline."""
    a, b = two_hosts
    with SpoolClient(b.root, create=False, rescan_s=0.2, no_worker_grace_s=5.0) as client:
        client.submit(make_request("r1", prompts=["hostB"]))
        with pytest.raises((NoLiveWorker, ResultTimeout)):
            client.wait(["r1"], timeout_s=1.0)  # looks for the result while it is absent
        worker = run_worker(a, worker_id="host-a", rescan_s=0.2)  # its spool is host A's mount
        results = client.wait(["r1"], timeout_s=min(30.0, NEGATIVE_CACHE_S / 4))
        # The worker now waits for work: a new request from host B reaches it as well.
        client.submit(make_request("r2", prompts=["again"]))
        results |= client.wait(["r2"], timeout_s=min(30.0, NEGATIVE_CACHE_S / 4))
    assert results["r1"].ok and results["r1"].texts == [["hostB"] * 2]
    assert results["r2"].ok and results["r2"].texts == [["again"] * 2]
    assert {r.worker_id for r in results.values()} == {"host-a"}
    assert worker.worker._waker.polling  # chosen by itself on FUSE
    # The worker archives r2's request just after it publishes r2's result, which the producer
    # may already have read and consumed: wait for the archive rather than look once.
    archived = [f"r{i}.{kind}.json" for i in (1, 2) for kind in ("request", "result")]
    wait_for(lambda: sorted(os.listdir(a.done)) == archived, what=f"done/ to hold {archived}")


def test_a_request_id_used_on_another_host_is_refused(two_hosts, make_request, wait_for):
    """submit looks for an id in listings too: a result host A published after host B looked
    for the id is still found."""
    a, b = two_hosts
    assert b.locate("r2") == []
    a.publish_results([Result.failure("r2", ErrorCode.ENGINE_ERROR, "served on A")])
    wait_for(lambda: b.locate("r2"), what="host B's listing to show the result")  # its directory cache
    with pytest.raises(RequestExists, match="'r2'"):
        b.submit(make_request("r2"))


# -- link() that reports failure after success -----------------------------------------------------


@pytest.fixture
def link_fails_after_success(monkeypatch):
    """os.link as NFSv3 can behave: the link is made, the reply is lost, the retransmitted
    request finds the name taken and reports EEXIST."""
    real_link = os.link
    calls = []

    def link(src, dst, *args, **kwargs):
        calls.append(dst)
        real_link(src, dst, *args, **kwargs)
        raise FileExistsError(17, "File exists (retransmitted LINK)", str(dst))

    monkeypatch.setattr(fsio.os, "link", link)
    return calls


def test_a_result_whose_link_reported_failure_after_success_is_published(spool, link_fails_after_success):
    result = Result.failure("r1", ErrorCode.ENGINE_ERROR, "ours")
    assert spool.publish_results([result]) == [True]
    assert link_fails_after_success == [spool.result_path("r1")]
    assert spool.read_result("r1") == result
    assert os.listdir(spool.tmp) == []
    # Someone else's result in place is still someone else's: ours is not published.
    assert spool.publish_results([Result.failure("r1", ErrorCode.ENGINE_ERROR, "a duplicate")]) == [False]
    assert spool.read_result("r1") == result


def test_a_request_whose_link_reported_failure_after_success_is_submitted(
    spool, make_request, link_fails_after_success
):
    request = make_request("r1")
    assert spool.submit(request) == spool.request_path("r1")
    assert [e.name for e in spool.pending()] == ["r1.json"] and os.listdir(spool.tmp) == []


def test_a_worker_whose_link_reports_failure_after_success_publishes_once(
    spool, make_request, run_worker, wait_for, link_fails_after_success
):
    spool.submit(make_request("r1", prompts=["abc"]))
    handle = run_worker(spool)
    wait_for(lambda: handle.counters.requests_ok == 1, what="the request to count as served")
    assert spool.read_result("r1").texts == [["abc", "abc"]]
    assert os.listdir(spool.claimed) == [] and handle.counters.requests_abandoned == 0


# -- leases judged by change, on the observer's clock ------------------------------------------------


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class SkewedWorker:
    """A worker on a host whose clock is `offset_s` off, on a filesystem that stamps files with
    the writer's clock (as Lustre and CephFS do): its status file's mtime and `heartbeat_at`
    are its own time."""

    def __init__(self, spool: Spool, worker_id: str, offset_s: float):
        self.spool, self.worker_id, self.offset_s = spool, worker_id, offset_s
        self.beats = 0

    def beat(self) -> None:
        self.beats += 1
        its_now = time.time() + self.offset_s + self.beats * 1e-3  # each beat a new time, even within a tick
        status = WorkerStatus(
            worker_id=self.worker_id, pid=1, host="elsewhere", device="cpu", engine="echo", state="generating",
            lease_s=LEASE_S, started_at=its_now, heartbeat_at=its_now,
        )  # fmt: skip
        self.spool.write_status(status)
        os.utime(self.spool.status_path(self.worker_id), (its_now, its_now))


@pytest.fixture
def observed(tmp_path, make_request):
    """(observer's spool with a hand-moved clock, its clock, a claim by worker "far")."""
    clock = Clock()
    spool = Spool(tmp_path / "spool", create=True, clock=clock)
    spool.submit(make_request("r1"))
    spool.claim(spool.pending()[0], "far")
    return spool, clock


@pytest.mark.parametrize("offset_s", [-HOURS, HOURS])
def test_a_beating_worker_keeps_its_claims_whatever_its_clock(observed, offset_s):
    spool, clock = observed
    worker = SkewedWorker(spool, "far", offset_s)
    for _ in range(30):  # ten leases, a beat every third of the lease
        worker.beat()
        assert spool.recover_stale() == []
        clock.now += LEASE_S / 3
        assert spool.recover_stale() == []  # just before the next beat
    assert [s.worker_id for s in spool.live_workers()] == ["far"]
    assert os.listdir(spool.claimed) == ["r1@far.json"]


@pytest.mark.parametrize("offset_s", [-HOURS, HOURS])
def test_a_worker_that_stops_beating_loses_its_claims_after_its_lease_whatever_its_clock(observed, offset_s):
    spool, clock = observed
    worker = SkewedWorker(spool, "far", offset_s)
    for _ in range(3):
        worker.beat()
        assert spool.recover_stale() == []
        clock.now += LEASE_S / 3
    worker.beat()  # the last beat
    assert spool.recover_stale() == []  # seen changing: the lease counts from here
    clock.now += LEASE_S * 0.9
    assert spool.recover_stale() == [] and [s.worker_id for s in spool.live_workers()] == ["far"]
    clock.now += LEASE_S * 0.2
    assert spool.recover_stale() == ["r1.json"]
    assert spool.live_workers() == []


def test_a_first_look_never_takes_claims(observed):
    """An observer that never saw a heartbeat cannot tell a dead worker from one whose clock runs
    behind: it watches half the lease before it takes claims. Liveness hints (a producer's
    "no live worker") may use the first look's guess, which the next beat corrects."""
    spool, clock = observed
    SkewedWorker(spool, "far", -HOURS).beat()  # hours old, by every clock but its own
    assert spool.recover_stale() == []
    assert spool.live_workers() == []  # the guess
    clock.now += LEASE_S / 2
    assert spool.recover_stale() == ["r1.json"]  # stood still for half its lease: dead


def test_first_sight_ages_use_the_filesystems_clock_not_this_hosts(observed, monkeypatch):
    """The first look compares the heartbeat's mtime with the mtime of a file just written, both
    stamped by the filesystem: this host's clock being hours off changes nothing."""
    spool, _ = observed
    SkewedWorker(spool, "far", 0.0).beat()
    import protocol.spool as spool_module

    monkeypatch.setattr(spool_module.time, "time", lambda: 1e9)  # 2001: this host's clock is far off
    assert [s.worker_id for s in spool.live_workers()] == ["far"]
