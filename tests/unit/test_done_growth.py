"""done/ grows without bound between prunes (every served request and every consumed result
stays there), so nothing a request passes through may list it: a worker serving, a producer
submitting and waiting. Their cost and memory then do not grow with done/; `spoolctl prune`
is the one reader of the whole directory. bench/spool_load.py measures the same at 100,000
files (docs/BENCHMARKS.md)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from protocol.client import SpoolClient
from protocol.spool import Spool


class ListingRecorder:
    """Wraps os.listdir and os.scandir, recording each directory listed (any thread)."""

    def __init__(self, monkeypatch):
        self.listed: list[Path] = []
        listdir, scandir = os.listdir, os.scandir

        def recorded_listdir(path="."):
            self.listed.append(Path(os.fsdecode(path)).absolute())
            return listdir(path)

        def recorded_scandir(path="."):
            self.listed.append(Path(os.fsdecode(path)).absolute())
            return scandir(path)

        monkeypatch.setattr(os, "listdir", recorded_listdir)
        monkeypatch.setattr(os, "scandir", recorded_scandir)

    def count(self, directory: Path) -> int:
        return sum(p == directory.absolute() for p in self.listed)


def test_serving_and_collecting_never_list_done(spool: Spool, make_request, run_worker, monkeypatch):
    for i in range(50):  # what earlier requests left there
        spool.archived_request_path(f"old-{i}").write_text("{}")
    recorder = ListingRecorder(monkeypatch)
    handle = run_worker(spool)
    with SpoolClient(spool.root, no_worker_grace_s=30) as client:
        for round_ in range(3):  # one at a time, then a batch
            ids = [f"r{round_}-{i}" for i in range(1 if round_ < 2 else 20)]
            client.submit_many([make_request(i) for i in ids])
            results = client.wait(ids, timeout_s=30)
            assert all(results[i].ok for i in ids)
    assert handle.stop() == 0
    listings_of_done, scans_of_requests = recorder.count(spool.done), recorder.count(spool.requests)
    assert scans_of_requests > 0  # the recorder sees the worker's scans
    assert listings_of_done == 0, f"done/ listed {listings_of_done} times for 22 requests: cost grows with done/"
    assert len(os.listdir(spool.done)) == 50 + 2 * 22  # each served request and consumed result archived


def test_prune_keeps_done_bounded(spool: Spool):
    for i in range(30):
        spool.archived_request_path(f"old-{i}").write_text("{}")
        spool.consumed_result_path(f"old-{i}").write_text("{}")
    assert spool.prune(done_older_than_s=0.5, now=time.time() + 1)["done"] == 60
    assert os.listdir(spool.done) == []
