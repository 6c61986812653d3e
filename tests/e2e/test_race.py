"""Races at the spool level: two workers going for the same request.

A claim is a rename out of requests/, so exactly one of two racing claimers wins. A result is
published with a no-replace link, so exactly one of two racing publishers wins and the file keeps
the winner's bytes. Each race is repeated many times, between threads (released GIL around the
syscalls) and between processes (truly parallel).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path

import pytest

from protocol.messages import Request, Result, decode_result
from protocol.spool import Entry, Spool

ROUNDS = 300  # races per thread test
PROC_IDS = 400  # ids raced over by two processes


def _request(request_id: str) -> Request:
    return Request(
        request_id=request_id,
        weights_dir="/models/echo",
        prompts=[request_id],
        n_samples_per_prompt=1,
        max_tokens=64,
        temperature=0.0,
    )


def _result(request_id: str, worker_id: str) -> Result:
    return Result(request_id=request_id, ok=True, texts=[[request_id]], worker_id=worker_id)


def _race(*calls):
    """Run the calls at once from threads released by one barrier; their return values in order."""
    barrier = threading.Barrier(len(calls))
    out: list = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i, call):
        try:
            barrier.wait()
            out[i] = call()
        except BaseException as exc:  # surfaced below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not errors, errors
    return out


@pytest.mark.timeout(60)
def test_two_claims_on_one_entry_one_wins(tmp_path):
    spool = Spool(tmp_path / "spool", create=True)
    wins = {"wA": 0, "wB": 0}
    for i in range(ROUNDS):
        rid = f"claim-{i:04d}"
        spool.submit(_request(rid))
        (entry,) = spool.pending()
        a, b = _race(lambda e=entry: spool.claim(e, "wA"), lambda e=entry: spool.claim(e, "wB"))
        assert (a is None) != (b is None), f"round {i}: both or neither claimed ({a}, {b})"
        winner = a or b
        wins[winner.worker_id] += 1
        assert os.listdir(spool.requests) == []
        assert os.listdir(spool.claimed) == [winner.path.name]
        assert spool.holds(winner)
        assert spool.load(winner).request_id == rid
        spool.finish(winner)
    assert os.listdir(spool.claimed) == []
    print(f"\nclaim race: {ROUNDS} rounds, wins {wins}")


@pytest.mark.timeout(60)
def test_two_publishes_of_one_id_first_wins(tmp_path):
    spool = Spool(tmp_path / "spool", create=True)
    wins = {"wA": 0, "wB": 0}
    for i in range(ROUNDS):
        rid = f"pub-{i:04d}"
        ra, rb = _result(rid, "wA"), _result(rid, "wB")
        a, b = _race(lambda r=ra: spool.publish_results([r]), lambda r=rb: spool.publish_results([r]))
        assert a[0] != b[0], f"round {i}: publish returned {a} and {b}"
        winner = "wA" if a[0] else "wB"
        wins[winner] += 1
        assert spool.read_result(rid).worker_id == winner
        # A late publisher never replaces the file either.
        assert spool.publish_results([_result(rid, "late")]) == [False]
        assert spool.read_result(rid).worker_id == winner
    assert sorted(os.listdir(spool.results)) == [f"pub-{i:04d}.json" for i in range(ROUNDS)]
    assert os.listdir(spool.tmp) == []  # losers' scratch files are removed too
    print(f"\npublish race: {ROUNDS} rounds, wins {wins}")


# -- the same races between processes ---------------------------------------------------------


def _claim_all(root: str, worker_id: str, names: list[str], barrier, conn) -> None:
    spool = Spool(root)
    won = []
    for name in names:
        barrier.wait(timeout=30)  # both processes go for this entry at once
        # The entry as a scan would have shown it to both workers.
        claim = spool.claim(Entry(name, spool.requests / name, 0.0, 0.0, 0), worker_id)
        if claim is not None:
            won.append(name)
    conn.send(won)
    conn.close()


def _publish_all(root: str, worker_id: str, ids: list[str], barrier, conn) -> None:
    spool = Spool(root)
    won = []
    for rid in ids:
        barrier.wait(timeout=30)  # both processes publish this id at once
        if spool.publish_results([_result(rid, worker_id)])[0]:
            won.append(rid)
    conn.send(won)
    conn.close()


def _run_two(target, root: Path, items: list[str]) -> dict[str, list[str]]:
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    procs, pipes = {}, {}
    for worker_id in ("wA", "wB"):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=target, args=(str(root), worker_id, items, barrier, child), daemon=True)
        p.start()
        child.close()
        procs[worker_id], pipes[worker_id] = p, parent
    try:
        won = {w: pipes[w].recv() if pipes[w].poll(60) else None for w in procs}
        codes = [p.exitcode for p in procs.values()]
        assert None not in won.values(), f"a racer did not report: {won}, exit codes {codes}"
        for p in procs.values():
            p.join(timeout=10)
            assert p.exitcode == 0
        return won
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join()


@pytest.mark.timeout(90)
def test_two_processes_claiming_the_same_entries(tmp_path):
    spool = Spool(tmp_path / "spool", create=True)
    ids = [f"pc-{i:04d}" for i in range(PROC_IDS)]
    spool.submit_many([_request(rid) for rid in ids])
    won = _run_two(_claim_all, spool.root, [f"{rid}.json" for rid in ids])
    a, b = set(won["wA"]), set(won["wB"])
    assert not a & b, f"claimed by both: {sorted(a & b)[:5]}"
    assert a | b == {f"{rid}.json" for rid in ids}
    assert os.listdir(spool.requests) == []
    assert len(os.listdir(spool.claimed)) == PROC_IDS
    print(f"\nclaim race between processes: {PROC_IDS} entries, wA won {len(a)}, wB won {len(b)}")


@pytest.mark.timeout(90)
def test_two_processes_publishing_the_same_ids(tmp_path):
    spool = Spool(tmp_path / "spool", create=True)
    ids = [f"pp-{i:04d}" for i in range(PROC_IDS)]
    won = _run_two(_publish_all, spool.root, ids)
    a, b = set(won["wA"]), set(won["wB"])
    assert not a & b, f"published by both: {sorted(a & b)[:5]}"
    assert a | b == set(ids)
    for rid in ids:
        data = (spool.results / f"{rid}.json").read_bytes()
        assert decode_result(data).worker_id == ("wA" if rid in a else "wB")
    assert sorted(os.listdir(spool.results)) == sorted(f"{rid}.json" for rid in ids)
    assert os.listdir(spool.tmp) == []
    print(f"\npublish race between processes: {PROC_IDS} ids, wA won {len(a)}, wB won {len(b)}")


@pytest.mark.timeout(30)
def test_duplicate_result_after_consume_is_refused(tmp_path):
    spool = Spool(tmp_path / "spool", create=True)
    assert spool.publish_results([_result("c-1", "wA")]) == [True]
    spool.consume_result("c-1")  # the producer read it; it now lives in done/
    # A duplicate execution (the claim was recovered from a slow worker) finishes later:
    assert spool.publish_results([_result("c-1", "wB")]) == [False]
