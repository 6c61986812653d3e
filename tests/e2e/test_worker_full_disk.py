"""A really full disk under a real `rollout-svc serve` process: the spool (or the metrics
directory) on a small tmpfs that the test fills (tests/small_fs.py), so every write fails with
ENOSPC as on a full disk, not by a limit on the worker.

What must hold: the worker exits CANNOT_WRITE (74) with the file it could not write named in
its log, whether that is its status file, a result or a bad/ note; nothing is torn (no partial
file in requests/, results/, workers/, and tmp/ and claimed/ empty); nothing is lost (every
request is still in requests/ or answered); and once the operator makes room (`grow`), a
relaunched worker serves everything. A metrics textfile that cannot be written only warns,
once: monitoring never stops the service.

The echo engine serves where the engine is not the point; one test runs the vLLM engine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import poll, start_worker, stop_worker, wait_for_status
from small_fs import SmallTmpfs, small_tmpfs

from protocol import exit_codes
from protocol.messages import Request, decode_result, encode
from protocol.spool import Spool, id_from_name

pytestmark = pytest.mark.timeout(600)

ECHO = ("--engine", "echo", "--idle-exit", "0")
MiB = 2**20


def echo_request(request_id: str, prompt: str = "hello", max_tokens: int = 8, weights_dir: str = "/models/any"):
    return Request(
        request_id=request_id, weights_dir=weights_dir, prompts=[prompt], n_samples_per_prompt=1,
        max_tokens=max_tokens, temperature=0.0,
    )  # fmt: skip


def log_of(log_dir: Path, worker_id: str) -> str:
    return (log_dir / f"{worker_id}.log").read_text(errors="replace")


@pytest.fixture
def disk(tmp_path):
    with small_tmpfs(tmp_path / "disk", 2 * MiB) as mounted:
        yield mounted


def stage(spool: Spool, name: str, data: bytes) -> None:
    """Write a request file as hidden (workers skip hidden names) while there is room."""
    (spool.requests / f".{name}").write_bytes(data)


def unveil(spool: Spool) -> None:
    """Show the staged files to the worker: a rename needs no room, even on a full disk."""
    for entry in os.scandir(spool.requests):
        if entry.name.startswith("."):
            os.rename(entry.path, spool.requests / entry.name[1:])


def nothing_torn_nothing_lost(spool: Spool, names: list[str]) -> None:
    """No partial file anywhere; each request whole in requests/, or answered (or kept in bad/
    with its note, for a name with no id)."""
    assert os.listdir(spool.tmp) == [] and os.listdir(spool.claimed) == [] and os.listdir(spool.workers) == []
    for name in os.listdir(spool.results):
        decode_result((spool.results / name).read_bytes())  # whole: it parses
    for name in names:
        request_id = id_from_name(name)
        if (spool.requests / name).exists():
            assert (spool.requests / name).stat().st_size > 0
        elif request_id is not None:
            assert spool.has_result(request_id), f"{name} is neither in requests/ nor answered"
        else:
            assert spool.bad_path(name).exists() and spool.bad_note_path(name).read_text().strip(), name


def relaunch_serves_everything(spool: Spool, disk: SmallTmpfs, tmp_path: Path, client, ids: list[str]) -> None:
    disk.grow(64 * MiB)  # the operator made room; the files stay
    worker = start_worker(spool.root, "after", *ECHO, log_dir=tmp_path)
    try:
        results = client.wait(ids, timeout_s=120)
        assert all(results[rid].ok for rid in ids), {rid: results[rid].error for rid in ids}
        poll(lambda: os.listdir(spool.requests), lambda names: names == [])
    finally:
        assert stop_worker(worker) == exit_codes.OK, log_of(tmp_path, "after")[-3000:]
    assert os.listdir(spool.requests) == [] and os.listdir(spool.claimed) == []


def test_a_status_file_the_full_disk_cannot_hold_exits_74_naming_it(tmp_path, disk, client_for):
    spool = Spool(disk.path / "spool", create=True)
    names = ["r1.json", "r2.json", "not an id.json"]
    for name in names:
        stage(spool, name, encode(echo_request(id_from_name(name) or "x")))
    unveil(spool)
    disk.fill()
    worker = start_worker(spool.root, "full", *ECHO, log_dir=tmp_path)
    assert worker.wait(timeout=120) == exit_codes.CANNOT_WRITE, log_of(tmp_path, "full")[-3000:]
    log = log_of(tmp_path, "full")
    assert "No space left on device" in log and f"-> '{spool.status_path('full')}'" in log
    assert "cannot write to the spool" in log and "Free space" in log
    nothing_torn_nothing_lost(spool, names)
    assert sorted(os.listdir(spool.requests)) == sorted(names)  # claimed nothing without a heartbeat
    relaunch_serves_everything(spool, disk, tmp_path, client_for(spool.root), ["r1", "r2"])
    assert "not an id.json" in os.listdir(spool.bad)


def test_a_result_the_full_disk_cannot_hold_goes_back_and_a_relaunch_serves_it(tmp_path, disk, client_for):
    spool = Spool(disk.path / "spool", create=True)
    client = client_for(spool.root)
    worker = start_worker(spool.root, "full", *ECHO, log_dir=tmp_path)
    try:
        client.submit(echo_request("small"))
        assert client.wait(["small"], timeout_s=60)["small"].ok
        big_prompt = "x" * 20_000  # its result holds 20,000 token ids: far more than the room left
        stage(spool, "big.json", encode(echo_request("big", prompt=big_prompt, max_tokens=20_000)))
        disk.fill(leave_bytes=64 * 1024)  # room for status files, not for that result
        unveil(spool)
        assert worker.wait(timeout=120) == exit_codes.CANNOT_WRITE, log_of(tmp_path, "full")[-3000:]
    finally:
        stop_worker(worker)
    log = log_of(tmp_path, "full")
    assert "No space left on device" in log and f"-> '{spool.result_path('big')}'" in log
    assert "gave back 1 requests" in log
    nothing_torn_nothing_lost(spool, ["big.json", "small.json"])
    assert spool.request_path("big").exists() and not spool.has_result("big")
    relaunch_serves_everything(spool, disk, tmp_path, client, ["big"])
    assert client.wait(["big"], timeout_s=10)["big"].texts == [[big_prompt]]


def test_a_bad_note_the_full_disk_cannot_hold_keeps_the_file_in_requests(tmp_path, disk, client_for):
    spool = Spool(disk.path / "spool", create=True)
    client = client_for(spool.root)
    # Long heartbeats: the note, not the status file, is what meets the full disk first.
    worker = start_worker(spool.root, "full", *ECHO, "--heartbeat", "100", "--lease", "300", log_dir=tmp_path)
    name = "not an id.json"  # no id, so no result: a note in bad/ says why it was refused
    try:
        wait_for_status(spool, "full", lambda s: s.state == "idle", 60, worker)
        stage(spool, name, encode(echo_request("r1")))
        disk.fill()
        unveil(spool)
        assert worker.wait(timeout=120) == exit_codes.CANNOT_WRITE, log_of(tmp_path, "full")[-3000:]
    finally:
        stop_worker(worker)
    log = log_of(tmp_path, "full")
    assert "No space left on device" in log and f"-> '{spool.bad_note_path(name)}'" in log
    assert "gave back 1 requests" in log and "Free space" in log
    nothing_torn_nothing_lost(spool, [name])
    assert (spool.requests / name).exists()  # not in bad/ without its note
    relaunch_serves_everything(spool, disk, tmp_path, client, [])
    assert spool.bad_note_path(name).read_text().startswith("invalid_request")
    assert spool.bad_path(name).exists()


def test_a_metrics_textfile_the_full_disk_cannot_hold_only_warns_once(tmp_path, disk, client_for):
    spool = Spool(tmp_path / "spool", create=True)
    client = client_for(spool.root)
    metrics_dir = disk.path / "metrics"
    metrics_dir.mkdir()
    disk.fill()
    worker = start_worker(spool.root, "w", *ECHO, "--metrics-dir", str(metrics_dir), log_dir=tmp_path)
    textfile = metrics_dir / "rollout_svc_w.prom"
    try:
        for i in range(3):  # each served request is a loop turn, each turn writes the textfile
            client.submit(echo_request(f"r{i}"))
            assert client.wait([f"r{i}"], timeout_s=60)[f"r{i}"].ok
        log = log_of(tmp_path, "w")
        assert log.count(f"metrics textfile {textfile} not written") == 1, log[-3000:]
        assert "No space left on device" in log and "serving on" in log
        assert not textfile.exists()
        disk.grow(64 * MiB)
        text = poll(lambda: textfile.read_text() if textfile.exists() else "", lambda t: "rollout_requests" in t)
        assert 'rollout_requests_total{outcome="ok",worker="w"} 3.0' in text
        poll(lambda: log_of(tmp_path, "w"), lambda log: "written again" in log)
        assert f"metrics textfile {textfile} written again" in log_of(tmp_path, "w")
    finally:
        assert stop_worker(worker) == exit_codes.OK, log_of(tmp_path, "w")[-3000:]
    assert os.listdir(metrics_dir) == [textfile.name]  # no scratch file of a failed write left behind


def test_a_vllm_worker_on_a_full_disk_gives_its_request_back(tmp_path, disk, client_for, models):
    spool = Spool(disk.path / "spool", create=True)
    client = client_for(spool.root)
    args = [
        "--engine", "vllm", "--allowed-root", str(models["root"]), "--weights", str(models["a"]),
        "--max-model-len", "64", "--idle-exit", "0",
    ]  # fmt: skip
    worker = start_worker(spool.root, "vllm-full", *args, log_dir=tmp_path)
    try:
        wait_for_status(spool, "vllm-full", lambda s: s.state == "idle" and bool(s.weights_dir), 420, worker)
        request = echo_request("v", prompt="1+1=", max_tokens=8, weights_dir=str(models["a"]))
        stage(spool, "v.json", encode(request))
        disk.fill()
        unveil(spool)
        assert worker.wait(timeout=300) == exit_codes.CANNOT_WRITE, log_of(tmp_path, "vllm-full")[-3000:]
    finally:
        stop_worker(worker)
    log = log_of(tmp_path, "vllm-full")
    assert "No space left on device" in log and "cannot write to the spool" in log
    assert f"'{spool.root}/" in log  # the file is named
    nothing_torn_nothing_lost(spool, ["v.json"])
    assert spool.request_path("v").exists()
    relaunch_serves_everything(spool, disk, tmp_path, client, ["v"])
