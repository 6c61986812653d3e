"""Bad input never crashes a worker (DESIGN.md section 2, guarantee 3).

A real echo worker serves the whole corpus of bad request files (tests/corpus, plus the entries
that cannot be stored as plain files) and valid requests around them. Each bad case must get its
stable error code and a message naming the problem, be kept in bad/, and leave the worker up.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time

import pytest

from protocol import fsio
from protocol.messages import ErrorCode, decode_result
from protocol.spool import id_from_name

pytestmark = pytest.mark.timeout(60)


def test_corpus_and_expected_table_agree(corpus):
    on_disk = {p.name for p in corpus.directory.iterdir()} - {"expected.json"}
    assert on_disk == set(corpus.files)
    for case, spec in corpus.cases.items():
        assert set(spec) == {"request_file", "code", "mentions"}, case
        assert ErrorCode(spec["code"]), case
        assert spec["mentions"], case
    names = [spec["request_file"] for spec in corpus.cases.values()]
    assert len(names) == len(set(names)), "two cases would overwrite each other in requests/"


def test_corpus_covers_every_bad_input_code_a_file_can_cause(corpus):
    codes = {spec["code"] for spec in corpus.cases.values()}
    assert codes == {"bad_json", "invalid_request", "unsupported_schema", "id_mismatch", "too_large", "not_a_file"}
    assert any(id_from_name(spec["request_file"]) is None for spec in corpus.cases.values())


def _age_everything(directory, seconds: float) -> None:
    """Make every entry look older, so that later submissions are scanned after them."""
    past = time.time() - seconds
    for entry in os.scandir(directory):
        os.utime(entry.path, (past, past), follow_symlinks=False)


def _serve_until(spool, handle, wait_for, ids, notes=(), timeout=20.0):
    """Wait until each id has a result and each note exists, or the worker thread died."""

    def settled():
        if not handle.thread.is_alive():
            return True
        return all(spool.has_result(i) for i in ids) and all((spool.bad / n).exists() for n in notes)

    wait_for(settled, timeout=timeout, what=f"results for {ids} and notes {list(notes)}")
    assert handle.error is None, f"worker crashed: {handle.error!r}"
    assert handle.thread.is_alive(), f"worker exited early with {handle.rc}"


def test_worker_survives_the_whole_corpus(spool, corpus, run_worker, wait_for, make_request):
    corpus.place_all(spool)
    spool.submit(make_request("valid-among-bad", prompts=["first", "second"]))
    _age_everything(spool.requests, 60)
    cases = corpus.cases
    named = {case: id_from_name(spec["request_file"]) for case, spec in cases.items()}
    ids = [i for i in named.values() if i is not None] + ["valid-among-bad"]
    notes = [f"{spec['request_file']}.error.txt" for case, spec in cases.items() if named[case] is None]

    handle = run_worker(spool)
    _serve_until(spool, handle, wait_for, ids, notes)
    assert os.listdir(spool.requests) == []
    # The worker stayed up: a request submitted after every bad one is served too.
    spool.submit(make_request("valid-after-bad", prompts=["still here"], max_tokens=100))
    _serve_until(spool, handle, wait_for, ["valid-after-bad"])
    assert handle.stop() == 0 and handle.error is None

    expected_texts = {"valid-among-bad": [["first"] * 2, ["secon"] * 2], "valid-after-bad": [["still here"] * 2]}
    for request_id, texts in expected_texts.items():
        result = spool.read_result(request_id)
        assert result.ok and result.error is None, result.error
        assert result.texts == texts

    for case, spec in cases.items():
        request_file, code, mentions = spec["request_file"], spec["code"], spec["mentions"]
        request_id = named[case]
        if request_id is not None:
            result = decode_result((spool.results / f"{request_id}.json").read_bytes())
            assert result.ok is False, case
            assert result.error.code == ErrorCode(code), (case, result.error)
            assert mentions in result.error.message, (case, result.error.message)
            assert result.worker_id == "w1"
            assert result.texts == [] and result.token_ids == []
        else:
            note = (spool.bad / f"{request_file}.error.txt").read_text()
            assert note.startswith(f"{code}: "), (case, note)
            assert mentions in note, (case, note)
        _assert_kept_in_bad(spool, corpus, case, request_file)

    # The mismatched file is answered under its file name, never under the id it claims.
    assert not spool.has_result("someone-else")
    assert os.listdir(spool.claimed) == []
    assert os.listdir(spool.requests) == []
    assert os.listdir(spool.tmp) == []
    assert handle.counters.requests_ok == 2
    assert handle.counters.requests_failed == len(cases)


def _assert_kept_in_bad(spool, corpus, case, request_file):
    kept = spool.bad / request_file
    st = os.lstat(kept)
    if case in corpus.files:
        assert stat.S_ISREG(st.st_mode) and kept.read_bytes() == (corpus.directory / case).read_bytes(), case
    elif case in ("symlink", "dangling_symlink"):
        assert stat.S_ISLNK(st.st_mode), case
    elif case == "directory":
        assert stat.S_ISDIR(st.st_mode) and (kept / "inside.json").exists()
    elif case == "fifo":
        assert stat.S_ISFIFO(st.st_mode)
    elif case == "huge":
        assert stat.S_ISREG(st.st_mode) and st.st_size > 64 * 2**20
    else:
        pytest.fail(f"no check for {case}")


def test_a_bad_file_with_an_existing_result_keeps_the_first_result(spool, corpus, run_worker, wait_for, make_request):
    """A corrupt copy of an already served request is kept in bad/; the served result stands."""
    spool.submit(make_request("served"))
    handle = run_worker(spool)
    _serve_until(spool, handle, wait_for, ["served"])
    first = (spool.results / "served.json").read_bytes()
    (spool.tmp / "x").write_bytes(b'{"request_id": "served", "prompts": ')
    os.rename(spool.tmp / "x", spool.requests / "served.json")
    wait_for(lambda: (spool.bad / "served.json").exists(), what="the corrupt copy in bad/")
    assert handle.stop() == 0
    assert (spool.results / "served.json").read_bytes() == first


# -- bad input that still brings a worker down -----------------------------------------------------


def test_deeply_nested_json_does_not_crash_the_worker(spool, run_worker, wait_for, make_request):
    (spool.requests / "nested.json").write_bytes(b'{"request_id": "nested", "stop": ' + b"[" * 100_000)
    _age_everything(spool.requests, 60)
    spool.submit(make_request("valid-after-nested"))
    handle = run_worker(spool)
    _serve_until(spool, handle, wait_for, ["nested", "valid-after-nested"])
    assert spool.read_result("nested").error.code in (ErrorCode.BAD_JSON, ErrorCode.INVALID_REQUEST)
    assert spool.read_result("valid-after-nested").ok


def test_a_very_long_bad_file_name_does_not_crash_the_worker(spool, run_worker, wait_for, make_request):
    name = "long name " + "x" * 235 + ".json"  # 250 bytes: a legal file name, not a valid id
    (spool.requests / name).write_bytes(b"{}")
    _age_everything(spool.requests, 60)
    spool.submit(make_request("valid-after-long-name"))
    handle = run_worker(spool)
    _serve_until(spool, handle, wait_for, ["valid-after-long-name"])
    # The claim is archived after the result's link and directory fsync: wait with the usual margin.
    wait_for(lambda: not os.listdir(spool.claimed), what="an empty claimed/")
    assert (spool.bad / name).exists()
    assert os.listdir(spool.requests) == []


def test_an_unreadable_request_file_does_not_crash_the_worker(spool, run_worker, wait_for, make_request, monkeypatch):
    path = spool.requests / "unreadable.json"
    path.write_bytes(json.dumps({"request_id": "unreadable"}).encode())
    os.chmod(path, 0)
    if os.geteuid() == 0:  # root reads anything: make the read fail the way it does for others
        real = fsio.read_regular_file

        def read_regular_file(p, max_bytes):
            if "unreadable" in str(p):
                raise PermissionError(errno.EACCES, "Permission denied", str(p))
            return real(p, max_bytes)

        monkeypatch.setattr(fsio, "read_regular_file", read_regular_file)
    _age_everything(spool.requests, 60)
    spool.submit(make_request("valid-after-unreadable"))
    handle = run_worker(spool)
    _serve_until(spool, handle, wait_for, ["unreadable", "valid-after-unreadable"])
    assert not spool.read_result("unreadable").ok
    assert (spool.bad / "unreadable.json").exists()
