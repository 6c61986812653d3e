"""The parts of one call go to different idle workers, whoever scans first (real workers, real spool).

Worker A (vLLM, so its engine call lasts long enough to be caught in it) finds a two-part call
first, while worker B is idle but frozen before its scan: A must take one part and leave the
other to B. And peers that look idle but never come cost the call one more engine call of the
other worker, never their lease.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import ENGINE_START_TIMEOUT_S, kill_session, poll, start_worker, wait_for_status

from protocol.messages import Request, WorkerStatus, decode_status
from protocol.spool import Spool

pytestmark = pytest.mark.timeout(900)

LEASE_S = "120"  # a frozen worker stays live by its status for the whole test


def call(call_id: str, weights_dir, parts: int, **fields) -> list[Request]:
    fields = dict(prompts=[f"{i}+{i}=" for i in range(8)], n_samples_per_prompt=16, max_tokens=100) | fields
    weights_dir = str(weights_dir)
    return [
        Request(
            request_id=f"{call_id}-p{part}",
            call_id=call_id,
            weights_dir=weights_dir,
            temperature=1.0,
            seed=part,
            **fields,
        )
        for part in range(parts)
    ]


def served_by(spool: Spool, request_ids: list[str], timeout_s: float = 300.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        results = spool.read_results(request_ids)
        if len(results) == len(request_ids):
            assert all(r.ok for r in results.values()), [r.error for r in results.values()]
            return {request_id: result.worker_id for request_id, result in results.items()}
        assert time.monotonic() < deadline, f"only {sorted(results)} of {request_ids} answered"
        time.sleep(0.05)


def until_serving(spool: Spool, worker_id: str, timeout_s: float) -> None:
    """Polls often for the worker in its engine call: "generating" by its status and holding a
    claim. The status says "generating" from just before the first claim (so peers leave it parts),
    so the status alone can be caught a moment before the claim's rename. The engine call lasts a
    second or more, this poll a few ms."""
    deadline = time.monotonic() + timeout_s
    while not (
        decode_status(spool.status_path(worker_id).read_bytes()).state == "generating"
        and any(n.endswith(f"@{worker_id}.json") for n in os.listdir(spool.claimed))
    ):
        assert time.monotonic() < deadline, f"{worker_id} never started its engine call"
        time.sleep(0.005)


@pytest.fixture
def workers(tmp_path):
    procs = {}
    yield procs
    for proc in procs.values():
        try:
            os.killpg(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        kill_session(proc)
        proc.wait(timeout=30)


def test_the_worker_that_scans_first_leaves_the_other_part_to_its_idle_peer(models, tmp_path, workers):
    spool = Spool(tmp_path / "spool", create=True)
    common = ["--idle-exit", "0", "--lease", LEASE_S]
    workers["a"] = start_worker(
        spool.root, "fan-a", "--engine", "vllm", "--allowed-root", str(models["root"]), "--weights", str(models["a"]),
        "--max-model-len", "128", *common, log_dir=tmp_path,
    )  # fmt: skip
    workers["b"] = start_worker(spool.root, "fan-b", "--engine", "echo", *common, log_dir=tmp_path)
    ready = lambda s: s.state == "idle" and bool(s.weights_dir)  # noqa: E731
    wait_for_status(spool, "fan-a", ready, ENGINE_START_TIMEOUT_S, workers["a"])
    wait_for_status(spool, "fan-b", lambda s: s.state == "idle", 60, workers["b"])

    # Both frozen while the call lands, so A's first scan sees both parts; B stays frozen, idle by
    # its status, until A is caught in its engine call.
    for proc in workers.values():
        os.killpg(proc.pid, signal.SIGSTOP)
    parts = call("fan", models["a"], 2)
    spool.submit_many(parts)
    os.killpg(workers["a"].pid, signal.SIGCONT)
    until_serving(spool, "fan-a", timeout_s=300)
    os.killpg(workers["a"].pid, signal.SIGSTOP)
    assert not spool.read_results([p.request_id for p in parts]), "A's engine call ended before it was caught in it"
    held_by_a = sorted(n for n in os.listdir(spool.claimed) if n.endswith("@fan-a.json"))

    os.killpg(workers["b"].pid, signal.SIGCONT)
    deadline = time.monotonic() + 120  # B's next scan: a file event queued while it was frozen, or its rescan
    while os.listdir(spool.requests):
        assert time.monotonic() < deadline, "B left the pending part in requests/"
        time.sleep(0.05)
    os.killpg(workers["a"].pid, signal.SIGCONT)
    by = served_by(spool, [p.request_id for p in parts])
    assert held_by_a == ["fan-p0@fan-a.json"], held_by_a  # A took one part of the two
    assert sorted(by.values()) == ["fan-a", "fan-b"], by


def ghost_status(spool: Spool, worker_id: str) -> None:
    """The status file of a worker that says idle, with a long lease, and never comes."""
    now = time.time()
    status = WorkerStatus(
        worker_id=worker_id, pid=2**22 + 1, host="elsewhere", device="cpu", engine="echo", state="idle",
        lease_s=float(LEASE_S), started_at=now, heartbeat_at=now,
    )  # fmt: skip
    spool.write_status(status)


@pytest.mark.parametrize(("parts", "ghosts"), [(4, 1), (8, 7), (3, 1)])
def test_peers_that_look_idle_but_never_come_cost_one_engine_call_and_no_lease(tmp_path, workers, parts, ghosts):
    """Worker A finds a call while its peers look idle and never come: one is a real worker
    SIGKILLed while idle (its status stays for its lease), the others frozen by SIGSTOP or mere
    status files. A serves every part in two engine calls (its share, then all that is left), never
    one engine call per part, and never waits for a lease to run out."""
    spool = Spool(tmp_path / "spool", create=True)
    common = ["--engine", "echo", "--idle-exit", "0", "--lease", LEASE_S]
    names = ["a", "killed", "frozen"][: 1 + min(ghosts, 2)]
    for name in names:
        workers[name] = start_worker(spool.root, f"echo-{name}", *common, log_dir=tmp_path)
        wait_for_status(spool, f"echo-{name}", lambda s: s.state == "idle", 60, workers[name])
    for i in range(ghosts - (len(names) - 1)):
        ghost_status(spool, f"ghost-{i}")
    if "killed" in workers:
        os.killpg(workers["killed"].pid, signal.SIGKILL)
        workers["killed"].wait(timeout=30)
    if "frozen" in workers:
        os.killpg(workers["frozen"].pid, signal.SIGSTOP)
    os.killpg(workers["a"].pid, signal.SIGSTOP)  # so its first scan finds the whole call
    before = decode_status(spool.status_path("echo-a").read_bytes()).counters
    call_parts = call("late", "/models/none", parts, n_samples_per_prompt=1, max_tokens=4)
    spool.submit_many(call_parts)
    os.killpg(workers["a"].pid, signal.SIGCONT)
    by = served_by(spool, [p.request_id for p in call_parts], timeout_s=60)
    assert set(by.values()) == {"echo-a"}, by
    live = {s.worker_id for s in Spool(spool.root).live_workers()}
    assert {f"echo-{name}" for name in names[1:]} <= live  # their leases never ran out
    counters = poll(
        lambda: decode_status(spool.status_path("echo-a").read_bytes()).counters,
        lambda c: c.requests_ok - before.requests_ok >= parts,  # the status written after the last result
        timeout_s=30,
    )
    calls = counters.engine_calls - before.engine_calls
    assert calls == 2, f"{parts} parts with {ghosts} peers that never come took {calls} engine calls"
