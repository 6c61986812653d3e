"""Hostile and odd files in a spool, read by protocol's own readers: real FIFOs (a plain open()
waits for a writer forever), symlinks to devices, deeply nested JSON (json.loads raises
RecursionError), bytes that are not UTF-8. None of them blocks, raises out, or counts as a worker.

Every call that could block runs in a thread with a generous deadline, so a freeze fails the
test instead of hanging it. The filesystem check is tried on a real FAT mount in
tests/e2e/test_spool_filesystem.py; here its rename branch, which no mountable filesystem lacks.
"""

from __future__ import annotations

import errno
import logging
import os
import threading

import pytest

from protocol.client import SpoolClient
from protocol.jsonl import json_lines
from protocol.messages import ErrorCode, Result
from protocol.spool_filesystem import SpoolUnsupported, check_filesystem
from protocol.spool_names import weights_named

pytestmark = pytest.mark.timeout(120)

DEEP = b"[" * 100_000  # json.loads: RecursionError
DEADLINE_S = 30.0


def finishes(call, deadline_s: float = DEADLINE_S):
    """call()'s value, or a test failure if it is still running after `deadline_s`."""
    outcome: list = []

    def run():
        try:
            outcome.append(("value", call()))
        except BaseException as exc:  # handed to the test
            outcome.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)  # a thread stuck in open() cannot be ended
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        pytest.fail(f"blocked for {deadline_s} s on a hostile file")
    kind, value = outcome[0]
    if kind == "raised":
        raise value
    return value


def test_a_fifo_status_file_is_no_worker_never_blocks_and_is_logged_once(spool, caplog):
    from rollout_svc.status import Heartbeat

    live = Heartbeat(spool, worker_id="w1", engine="echo", device="cpu", lease_s=30, interval_s=1)
    live.beat()
    os.mkfifo(spool.workers / "zz.json")
    os.symlink("/dev/zero", spool.workers / "zero.json")
    caplog.set_level(logging.WARNING)
    for _ in range(3):  # three scans: one log line per file, not one per scan
        statuses = finishes(spool.statuses)
        assert {e.name: s is not None for e, s in statuses} == {"w1.json": True, "zz.json": False, "zero.json": False}
        assert [s.worker_id for s in finishes(spool.live_workers)] == ["w1"]
        assert finishes(lambda: spool.idle_peers(None, enough=5)) == []  # w1 is "starting", not idle
        assert finishes(lambda: spool.recover_stale()) == []
    logged = [r.getMessage() for r in caplog.records if "is not a worker's status" in r.getMessage()]
    assert sorted(m.split()[0] for m in logged) == ["workers/zero.json", "workers/zz.json"], logged
    assert "FIFO" in next(m for m in logged if "zz.json" in m)


def test_a_result_that_is_a_fifo_a_link_or_deep_json_is_that_requests_error(spool):
    os.mkfifo(spool.results / "fifo.json")
    os.symlink("/dev/zero", spool.results / "zero.json")
    (spool.results / "deep.json").write_bytes(DEEP)
    (spool.results / "latin.json").write_bytes(b'{"request_id": "latin", "\xff": 1}')
    spool.publish_results([Result.failure("fine", ErrorCode.ENGINE_ERROR, "m", worker_id="w")])
    found = finishes(lambda: spool.read_results(["fifo", "zero", "deep", "latin", "fine", "absent"]))
    assert sorted(found) == ["deep", "fifo", "fine", "latin", "zero"]
    for request_id, why in [("fifo", "FIFO"), ("zero", "symlink"), ("deep", ""), ("latin", "")]:
        error = found[request_id].error
        assert error.code is ErrorCode.BAD_RESULT and f"results/{request_id}.json" in error.message
        assert why in error.message and "spoolctl requeue" in error.message
    assert found["fine"].error.code is ErrorCode.ENGINE_ERROR


def test_a_producers_wait_reports_a_fifo_result_and_leaves_it(spool):
    os.mkfifo(spool.results / "fifo.json")
    with SpoolClient(spool.root, create=False) as client:
        result = finishes(lambda: client.wait(["fifo"], timeout_s=5))["fifo"]
    assert result.error.code is ErrorCode.BAD_RESULT
    assert os.path.lexists(spool.results / "fifo.json")  # not consumed: for an operator to look at


def test_publishing_over_a_planted_fifo_neither_blocks_nor_wins(spool):
    os.mkfifo(spool.results / "r1.json")
    published = finishes(lambda: spool.publish_results([Result.failure("r1", ErrorCode.ENGINE_ERROR, "m")]))
    assert published == [False] and os.listdir(spool.tmp) == []


def test_the_weights_named_by_the_spool_survive_any_request_file(spool, make_request, tmp_path):
    named = tmp_path / "weights" / "step_1"
    named.mkdir(parents=True)
    spool.submit(make_request("ok", weights_dir=str(named)))
    os.mkfifo(spool.requests / "fifo.json")
    os.symlink("/dev/zero", spool.requests / "zero.json")
    (spool.requests / "deep.json").write_bytes(DEEP)
    (spool.requests / "latin.json").write_bytes(b"\xff\xfe step_9")
    (spool.requests / "odd.json").mkdir()
    (spool.claimed / "claimed-deep@w1.json").write_bytes(b'{"weights_dir": ' + DEEP)
    found = finishes(lambda: weights_named(spool.root))
    assert found.paths == {os.path.realpath(named)}
    assert sorted(found.unparsed) == sorted([DEEP, b"\xff\xfe step_9", b'{"weights_dir": ' + DEEP])
    assert found.names(named) and found.names(tmp_path / "elsewhere" / "step_9")  # in latin.json's bytes
    assert not found.names(tmp_path / "weights" / "step_2")


def test_a_request_file_that_cannot_be_read_makes_the_names_unknown(spool, monkeypatch):
    import protocol.spool_names as spool_names

    (spool.requests / "secret.json").write_text("{}")
    real = spool_names.read_regular_file

    def refused(path, max_bytes):  # root reads any mode: EACCES as a user without the group sees it
        if os.path.basename(path) == "secret.json":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, max_bytes)

    monkeypatch.setattr(spool_names, "read_regular_file", refused)
    assert weights_named(spool.root) is None


def test_a_deep_json_line_of_a_prompt_file_is_named_not_raised(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'{"prompt": "a"}\n' + DEEP + b"\n")
    with pytest.raises(ValueError, match=r"rows.jsonl:2: nested too deeply"):
        list(json_lines(rows, ValueError))


def test_spoolctl_show_finishes_on_fifos_and_deep_json(spool):
    from typer.testing import CliRunner

    from protocol.cli import app

    os.mkfifo(spool.results / "r1.json")
    (spool.bad / "r1.json").write_bytes(DEEP)
    shown = finishes(lambda: CliRunner().invoke(app, ["show", "--json", "-s", str(spool.root), "r1"]))
    assert shown.exit_code == 0, shown.output
    assert "FIFO" in shown.output and "nested too deeply" in shown.output


def test_the_filesystem_check_passes_here_and_leaves_nothing(spool):
    check_filesystem(spool.root)
    assert os.listdir(spool.tmp) == []


def test_a_filesystem_without_atomic_rename_is_refused_with_one_message(spool, monkeypatch):
    # No filesystem that can be mounted here lacks rename(); some FUSE mounts refuse it over an
    # existing file (EPERM, ENOSYS), which is what this stands for.
    real = os.rename

    def refused(src, dst, *args, **kwargs):
        if os.path.basename(os.fspath(dst)).startswith(".fs-check"):
            raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), os.fspath(src))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", refused)
    with pytest.raises(SpoolUnsupported, match="without atomic rename over a file") as info:
        check_filesystem(spool.root)
    assert "put the spool on ext4" in str(info.value)
    assert os.listdir(spool.tmp) == []
    with pytest.raises(SpoolUnsupported):
        SpoolClient(spool.root)


def test_a_worker_whose_spool_stops_making_links_exits_74_instead_of_skipping_forever(
    spool, make_request, run_worker, monkeypatch, caplog
):
    spool.submit(make_request("r1"))
    real = os.link

    def no_links(src, dst, *args, **kwargs):  # the spool's filesystem remounted on a FAT, say
        if os.path.dirname(os.fspath(dst)) == str(spool.results):
            raise OSError(errno.EPERM, os.strerror(errno.EPERM), os.fspath(src), None, os.fspath(dst))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", no_links)
    handle = run_worker(spool)
    assert handle.join(15) == 74
    message = next(r.getMessage() for r in caplog.records if "cannot use the spool" in r.getMessage())
    assert "makes no hard links" in message and "gave back 1 requests" in message
    assert spool.request_path("r1").exists()  # nothing lost: back in requests/


def test_deep_json_in_a_weights_manifest_a_delta_header_or_a_fifo_manifest_is_a_clear_error(tmp_path):
    """Files a worker reads from a weights directory, hostile: a manifest of 100,000 `[`, a FIFO
    manifest (read without blocking) and a delta whose header nests as deep are refused with the
    contract's own errors, never a RecursionError or a hang."""
    from protocol import weight_delta
    from protocol.weights_dir import ManifestError, read_manifest

    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "manifest.json").write_bytes(b"[" * 100_000)
    with pytest.raises(ManifestError, match="not a weights manifest"):
        read_manifest(deep)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "manifest.json")
    with pytest.raises(ManifestError, match="not a regular file"):
        read_manifest(fifo)
    header = b"[" * 100_000
    with pytest.raises(weight_delta.DeltaInvalid):
        weight_delta.decode(len(header).to_bytes(8, "little") + header)
