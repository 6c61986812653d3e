"""The spool: one test per operation and per guarantee of spool.py and DESIGN.md section 2.

Every test that takes the `spool` fixture runs three times: on local disk, on an sshfs mount over
loopback with its caches on (attributes, listings, absent names), and on a FUSE passthrough
(bindfs); tests/netfs.py makes the mounts. Where /dev/fuse or a tool is missing they fail,
naming it."""

from __future__ import annotations

import errno
import json
import os
import stat
import string
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torn_reads import TornReadReader

from protocol import fsio
from protocol.client import NoLiveWorker, ResultTimeout, SpoolClient, WorkerAbsence
from protocol.messages import (
    ErrorCode,
    MessageError,
    Result,
    WorkerStatus,
    decode_request,
    decode_result,
    decode_status,
    encode_pretty,
    is_valid_worker_id,
)
from protocol.spool import (
    MAX_REQUEST_BYTES,
    STATES,
    Claim,
    RequestExists,
    Spool,
    SpoolError,
    claimed_name,
    id_from_name,
    name_for_id,
    split_claimed_name,
)
from protocol.watch import Waker, filesystem_type, needs_polling

pytestmark = pytest.mark.timeout(60)

CORPUS_CASES = sorted(json.loads((Path(__file__).resolve().parents[1] / "corpus" / "expected.json").read_text()))
RUNTIME_CASES = ["symlink", "dangling_symlink", "directory", "fifo", "huge"]
STORAGES = ("local", "sshfs", "bindfs")
# sftp creates neither fifos nor symlinks to absolute paths: no request file there can be one.
CANNOT_HOLD = {"sshfs": {"symlink", "dangling_symlink", "fifo"}}


@pytest.fixture(params=STORAGES)
def storage(request, storages, tmp_path) -> Path:
    """A fresh directory on each filesystem the spool must work on (see the module docstring)."""
    return storages.root(request.param, tmp_path.name, tmp_path)


@pytest.fixture
def spool(storage) -> Spool:
    return Spool(storage / "spool", create=True)


def status(worker_id: str = "w1", lease_s: float = 30.0, **fields) -> WorkerStatus:
    now = time.time()
    values = dict(
        worker_id=worker_id, pid=os.getpid(), host="host", device="cpu", engine="echo", state="idle",
        lease_s=lease_s, started_at=now, heartbeat_at=now,
    )  # fmt: skip
    values.update(fields)
    return WorkerStatus(**values)


def write_status(spool: Spool, worker_id: str, *, age_s: float = 0.0, lease_s: float = 30.0) -> Path:
    spool.write_status(status(worker_id, lease_s))
    path = spool.workers / f"{worker_id}.json"
    past = time.time() - age_s
    os.utime(path, (past, past))
    return path


def claim_one(spool: Spool, worker_id: str = "w1") -> Claim:
    entries = spool.pending()
    assert len(entries) == 1, entries
    claim = spool.claim(entries[0], worker_id)
    assert claim is not None
    return claim


def failure(request_id: str, message: str = "boom") -> Result:
    return Result.failure(request_id, ErrorCode.ENGINE_ERROR, message)


@pytest.fixture
def fsync_spy(monkeypatch):
    """Records fsyncs of regular files (count) and of directories (paths), still doing them."""
    calls = {"files": 0, "dirs": []}
    real_fsync, real_fsync_dir = os.fsync, fsio.fsync_dir

    def fsync(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            calls["files"] += 1
        return real_fsync(fd)

    def fsync_dir(path):
        calls["dirs"].append(Path(path))
        return real_fsync_dir(path)

    monkeypatch.setattr(fsio.os, "fsync", fsync)
    monkeypatch.setattr(fsio, "fsync_dir", fsync_dir)
    return calls


# -- layout --------------------------------------------------------------------------------------------


def test_create_makes_every_state_directory(tmp_path):
    spool = Spool(tmp_path / "new" / "spool", create=True)
    assert sorted(os.listdir(spool.root)) == sorted(STATES)
    for state in STATES:
        assert getattr(spool, state) == spool.root / state and getattr(spool, state).is_dir()


def test_path_methods_spell_the_documented_layout(spool):
    root = spool.root
    assert spool.request_path("r1") == root / "requests" / "r1.json"
    assert spool.claim_path("r1.json", "w1") == root / "claimed" / "r1@w1.json"
    assert spool.claim_path("no-extension", "w1") == root / "claimed" / "no-extension@w1"
    assert spool.result_path("r1") == root / "results" / "r1.json"
    assert spool.archived_request_path("r1") == root / "done" / "r1.request.json"
    assert spool.consumed_result_path("r1") == root / "done" / "r1.result.json"
    assert spool.bad_path("has space.json") == root / "bad" / "has space.json"
    assert spool.bad_note_path("has space.json") == root / "bad" / "has space.json.error.txt"
    assert spool.bad_note_path("n" * 300) == root / "bad" / f"{'n' * 200}.error.txt"
    assert spool.status_path("w1") == root / "workers" / "w1.json"
    scratch = spool.scratch_path("r1")
    assert scratch.parent == root / "tmp" and scratch.name.startswith("r1.") and scratch.name.endswith(".tmp")
    assert name_for_id("r1") == "r1.json" and id_from_name(name_for_id("r1")) == "r1"


def test_create_is_idempotent_and_keeps_content(spool, make_request):
    spool.submit(make_request("kept"))
    again = Spool(spool.root, create=True)
    assert [e.name for e in again.pending()] == ["kept.json"]


@pytest.mark.parametrize("present", [[], ["requests", "results"], [s for s in STATES if s != "workers"]])
def test_a_directory_that_is_not_a_spool_names_the_fix(tmp_path, present):
    for state in present:
        (tmp_path / state).mkdir()
    with pytest.raises(SpoolError) as info:
        Spool(tmp_path)
    message = str(info.value)
    assert f"spoolctl init {tmp_path}" in message
    missing = message.split(" is not a spool: missing ", 1)[1].split(". ", 1)[0]
    assert missing == ", ".join(f"{state}/" for state in STATES if state not in present)


def test_a_missing_root_is_not_a_spool(tmp_path):
    with pytest.raises(SpoolError, match="spoolctl init"):
        Spool(tmp_path / "nowhere")
    assert not (tmp_path / "nowhere").exists()


# -- submit ----------------------------------------------------------------------------------------------


def test_submit_is_durable_and_complete(spool, make_request, fsync_spy):
    request = make_request("r1", prompts=["a", "b"], seed=3, tag="eval")
    path = spool.submit(request)
    assert path == spool.requests / "r1.json"
    assert decode_request(path.read_bytes()) == request
    assert os.listdir(spool.tmp) == []
    assert fsync_spy["files"] >= 1  # the file's data
    assert spool.requests in fsync_spy["dirs"]  # and its directory entry


@pytest.mark.parametrize(
    "where",
    [
        "requests/{}.json",
        "claimed/{}@w9.json",
        "results/{}.json",
        "done/{}.request.json",
        "done/{}.result.json",
        "bad/{}.json",
    ],  # fmt: skip
)
def test_submit_refuses_an_id_in_use_in_any_state(spool, make_request, where):
    existing = spool.root / where.format("r1")
    existing.write_bytes(b"{}")
    with pytest.raises(RequestExists) as info:
        spool.submit(make_request("r1"))
    assert "'r1'" in str(info.value) and str(existing) in str(info.value) and "pick a new id" in str(info.value)
    assert existing.read_bytes() == b"{}"
    assert os.listdir(spool.tmp) == []
    if not where.startswith("requests/"):
        assert os.listdir(spool.requests) == []


def test_submit_many_publishes_all_with_one_directory_fsync(spool, make_request, fsync_spy):
    requests = [make_request(f"r{i}", prompts=[str(i)]) for i in range(5)]
    paths = spool.submit_many(requests)
    assert paths == [spool.requests / f"r{i}.json" for i in range(5)]
    assert [decode_request(p.read_bytes()) for p in paths] == requests
    assert fsync_spy["dirs"].count(spool.requests) == 1
    assert os.listdir(spool.tmp) == []


def test_submit_many_refuses_the_batch_when_one_id_exists(spool, make_request):
    spool.submit(make_request("r2"))
    with pytest.raises(RequestExists, match="'r2'"):
        spool.submit_many([make_request("r1"), make_request("r2"), make_request("r3")])
    assert os.listdir(spool.requests) == ["r2.json"]
    assert os.listdir(spool.tmp) == []


def test_submit_many_with_a_duplicate_id_publishes_nothing(spool, make_request):
    with pytest.raises(RequestExists):
        spool.submit_many([make_request("d1"), make_request("d1"), make_request("d2")])
    assert os.listdir(spool.requests) == []
    assert os.listdir(spool.tmp) == []


@pytest.mark.parametrize(
    ("request_id", "fields"),
    [("../escape", {}), ("zero-tokens", {"max_tokens": 0}), ("neg-temperature", {"temperature": -1.0})],
)
def test_submit_refuses_an_invalid_request(spool, make_request, request_id, fields):
    with pytest.raises((ValueError, SpoolError)):
        spool.submit(make_request(request_id, **fields))
    assert os.listdir(spool.requests) == []
    assert sorted(os.listdir(spool.root)) == sorted(STATES)


# -- pending and claim -----------------------------------------------------------------------------------


def test_pending_is_oldest_first_and_skips_hidden_files(spool):
    now = time.time()
    for name, age in [("b.json", 10), ("c.json", 30), ("a.json", 10), (".c.json.swp", 40), ("d.json", 20)]:
        path = spool.requests / name
        path.write_bytes(b"{}")
        os.utime(path, (now - age, now - age))
    entries = spool.pending()
    assert [e.name for e in entries] == ["c.json", "d.json", "a.json", "b.json"]  # ties by name
    assert [e.request_id for e in entries] == ["c", "d", "a", "b"]
    # sftp (sshfs) keeps whole seconds of mtime
    assert entries[0].mtime == pytest.approx(now - 30, abs=1.0) and entries[0].size == 2


def test_claim_is_a_rename_that_only_one_worker_wins(spool, make_request):
    spool.submit(make_request("r1"))
    entry = spool.pending()[0]
    claim = spool.claim(entry, "w1")
    assert claim == Claim("r1.json", spool.claimed / "r1@w1.json", "w1", entry.mtime)
    assert claim.request_id == "r1"
    assert os.listdir(spool.requests) == [] and os.listdir(spool.claimed) == ["r1@w1.json"]
    assert spool.claim(entry, "w1") is None
    assert spool.claim(entry, "w2") is None
    assert os.listdir(spool.claimed) == ["r1@w1.json"]


def test_claim_keeps_a_bad_name_recoverable(spool):
    (spool.requests / "no-extension").write_bytes(b"x")
    claim = claim_one(spool, "w1")
    assert claim.request_id is None
    assert split_claimed_name(claim.path.name) == ("no-extension", "w1")


def test_claim_works_for_the_longest_valid_ids(spool, make_request):
    request_id, worker_id = "r" * 128, "w" * 64
    assert is_valid_worker_id(worker_id) and not is_valid_worker_id(worker_id + "w")
    spool.submit(make_request(request_id))
    claim = claim_one(spool, worker_id)
    assert claim.request_id == request_id


names = st.builds(
    lambda a, b: a + b, st.sampled_from(string.ascii_letters), st.text(string.ascii_letters + "._- ", max_size=20)
)


@given(names, st.booleans(), names.filter(is_valid_worker_id))
def test_claimed_name_round_trip(stem, with_json, worker_id):
    name = stem + ".json" if with_json else stem
    assert split_claimed_name(claimed_name(name, worker_id)) == (name, worker_id)


def test_worker_ids_that_would_make_claimed_names_ambiguous_are_refused():
    # "a" claimed by "a.json" would be named as "a.json" claimed by "a"
    assert claimed_name("a", "a.json") == claimed_name("a.json", "a")
    assert not is_valid_worker_id("a.json") and is_valid_worker_id("a.json.1") and is_valid_worker_id("a")


@pytest.mark.parametrize(
    ("name", "request_id"),
    [("r1.json", "r1"), ("a.b-c_d.json", "a.b-c_d"), ("r1", None), ("has space.json", None), ("r1.JSON", None),
     (".hidden.json", None), ("x@y.json", None), (".json", None)],
)  # fmt: skip
def test_id_from_name(name, request_id):
    assert id_from_name(name) == request_id


# -- load ------------------------------------------------------------------------------------------------


def test_load_returns_the_request(spool, make_request):
    request = make_request("r1", stop=["\n"], deadline=123.0)
    spool.submit(request)
    assert spool.load(claim_one(spool)) == request


@pytest.mark.parametrize(
    ("storage", "case"),
    [
        (kind, case)
        for kind in STORAGES
        for case in CORPUS_CASES + RUNTIME_CASES
        if case not in CANNOT_HOLD.get(kind, ())
    ],
    indirect=["storage"],
)
def test_load_refuses_each_bad_input_with_its_code(spool, corpus, case):
    spec = corpus.cases[case]
    corpus.place(spool, case)
    claim = claim_one(spool)
    with pytest.raises(MessageError) as info:
        spool.load(claim)
    assert info.value.code == ErrorCode(spec["code"])
    assert spec["mentions"] in info.value.message
    assert spool.holds(claim)  # loading moves nothing; reject() does


def test_load_every_error_code_is_reachable(corpus):
    reachable = {corpus.cases[case]["code"] for case in CORPUS_CASES + RUNTIME_CASES}
    assert reachable == {"bad_json", "invalid_request", "unsupported_schema", "id_mismatch", "too_large", "not_a_file"}


def test_load_honours_a_smaller_size_limit(spool, make_request):
    spool.submit(make_request("r1"))
    claim = claim_one(spool)
    with pytest.raises(MessageError) as info:
        spool.load(claim, max_bytes=10)
    assert info.value.code is ErrorCode.TOO_LARGE and "more than the 10 accepted" in info.value.message
    assert spool.load(claim, max_bytes=MAX_REQUEST_BYTES).request_id == "r1"


def test_read_regular_file_refuses_symlinks_and_oversize(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"12345")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError) as info:
        fsio.read_regular_file(tmp_path / "link", 100)
    assert info.value.errno == errno.ELOOP
    with pytest.raises(ValueError, match="larger than 4 bytes"):
        fsio.read_regular_file(target, 4)
    assert fsio.read_regular_file(target, 5) == b"12345"


# -- holds, publish, finish, reject, release --------------------------------------------------------------


def test_holds_until_the_claim_is_taken_back(spool, make_request):
    spool.submit(make_request("r1"))
    claim = claim_one(spool)
    assert spool.holds(claim)
    assert spool.recover_stale(default_lease_s=0.0, now=time.time() + 1) == ["r1.json"]
    assert not spool.holds(claim)


def test_publish_results_first_wins(spool, fsync_spy):
    assert spool.publish_results([failure("r1", "first")]) == [True]
    first = (spool.results / "r1.json").read_bytes()
    assert spool.results in fsync_spy["dirs"]
    fsync_spy["dirs"].clear()
    assert spool.publish_results([failure("r1", "second")]) == [False]
    assert (spool.results / "r1.json").read_bytes() == first
    assert fsync_spy["dirs"] == []  # nothing new to make durable
    assert spool.publish_results([failure("r2"), failure("r1", "third")]) == [True, False]
    assert spool.read_result("r1").error.message == "first"
    assert os.listdir(spool.tmp) == []


def test_published_result_is_compact_and_decodes(spool):
    result = Result(request_id="r1", ok=True, texts=[["a", "b"]], token_ids=[[[1, 2], [3]]], worker_id="w1")
    spool.publish_results([result])
    data = (spool.results / "r1.json").read_bytes()
    assert decode_result(data) == result and b"\n" not in data


def test_finish_archives_the_request_in_done(spool, make_request):
    spool.submit(make_request("r1"))
    original = (spool.requests / "r1.json").read_bytes()
    claim = claim_one(spool)
    spool.finish(claim)
    assert os.listdir(spool.claimed) == []
    assert (spool.done / "r1.request.json").read_bytes() == original
    spool.finish(claim)  # the claim is gone: nothing to do, nothing raised


def test_reject_answers_a_valid_id_and_keeps_the_file_in_bad(spool):
    (spool.requests / "r1.json").write_bytes(b"{broken")
    claim = claim_one(spool)
    error = MessageError(ErrorCode.BAD_JSON, "not JSON")
    assert spool.reject(claim, error, worker_id="w1") is True
    result = spool.read_result("r1")
    assert (result.ok, result.error.code, result.error.message) == (False, ErrorCode.BAD_JSON, "not JSON")
    assert result.worker_id == "w1"
    assert result.finished_at > 0
    assert (spool.bad / "r1.json").read_bytes() == b"{broken"
    assert os.listdir(spool.claimed) == []
    # The same name again: the first result stands, both files are kept.
    (spool.requests / "r1.json").write_bytes(b"[again")
    assert spool.reject(claim_one(spool), MessageError(ErrorCode.BAD_JSON, "again")) is False
    assert spool.read_result("r1").error.message == "not JSON"
    assert (spool.bad / "r1.json.1").read_bytes() == b"[again"


@pytest.mark.parametrize("name", ["has space.json", "no-extension", "r1.JSON", "x@y.json"])
def test_reject_of_a_bad_name_leaves_a_note_and_no_result(spool, name):
    (spool.requests / name).write_bytes(b"content")
    claim = claim_one(spool)
    assert spool.reject(claim, MessageError(ErrorCode.INVALID_REQUEST, "bad name"), "w1") is False
    assert os.listdir(spool.results) == []
    assert (spool.bad / f"{name}.error.txt").read_text() == "invalid_request: bad name\n"
    assert (spool.bad / name).read_bytes() == b"content"
    assert os.listdir(spool.claimed) == [] and os.listdir(spool.tmp) == []


def test_release_gives_the_claim_back_unchanged(spool, make_request):
    spool.submit(make_request("r1"))
    before = os.stat(spool.requests / "r1.json")
    claim = claim_one(spool)
    spool.release(claim)
    assert os.listdir(spool.claimed) == []
    after = os.stat(spool.requests / "r1.json")
    assert after.st_mtime == before.st_mtime  # keeps its place in the queue
    assert spool.pending()[0].name == "r1.json"


# -- worker status and leases --------------------------------------------------------------------------


def test_write_status_and_statuses(spool):
    written = status("w1", last_error="x" * 1000)
    spool.write_status(written)
    (spool.workers / "corrupt.json").write_bytes(b'{"worker_id": "corr')
    (spool.workers / "notes.txt").write_bytes(b"ignored")
    found = {entry.name: decoded for entry, decoded in spool.statuses()}
    assert found == {"w1.json": written, "corrupt.json": None}
    assert os.listdir(spool.tmp) == []
    spool.write_status(status("w1", state="generating"))  # rewritten in place
    assert decode_status((spool.workers / "w1.json").read_bytes()).state == "generating"
    spool.remove_status("w1")
    spool.remove_status("w1")  # already gone: fine
    assert sorted(os.listdir(spool.workers)) == ["corrupt.json", "notes.txt"]


def test_live_workers_by_heartbeat_age(spool):
    write_status(spool, "fresh", age_s=0, lease_s=30)
    write_status(spool, "stale", age_s=100, lease_s=30)
    write_status(spool, "long-lease", age_s=100, lease_s=300)
    (spool.workers / "corrupt.json").write_bytes(b"{")
    assert sorted(s.worker_id for s in spool.live_workers()) == ["fresh", "long-lease"]
    assert [s.worker_id for s in spool.live_workers(now=time.time() + 150)] == ["long-lease"]
    assert spool.live_workers(now=time.time() + 1000) == []


def test_recover_stale_gives_back_only_dead_workers_claims(spool, make_request):
    write_status(spool, "dead", age_s=60, lease_s=5)
    write_status(spool, "live", age_s=0, lease_s=5)
    for request_id, worker_id in [("a", "dead"), ("b", "live"), ("c", "dead")]:
        spool.submit(make_request(request_id))
        spool.claim(next(e for e in spool.pending() if e.name == f"{request_id}.json"), worker_id)
    (spool.requests / "no-extension").write_bytes(b"x")
    spool.claim(next(e for e in spool.pending() if e.name == "no-extension"), "dead")

    # A first look never takes claims (a worker's slow clock can make its heartbeat look old);
    # one that watched the heartbeat stand still for half the lease does.
    assert spool.recover_stale() == []
    recovered = spool.recover_stale(now=time.time() + 3)
    assert sorted(recovered) == ["a.json", "c.json", "no-extension"]
    assert sorted(os.listdir(spool.requests)) == ["a.json", "c.json", "no-extension"]
    assert os.listdir(spool.claimed) == ["b@live.json"]
    assert spool.load(claim_one_named(spool, "a.json")).request_id == "a"  # intact
    assert spool.recover_stale() == []


def claim_one_named(spool, name):
    return spool.claim(next(e for e in spool.pending() if e.name == name), "w1")


def test_recover_stale_without_status_uses_claim_age_and_default_lease(spool, make_request):
    spool.submit(make_request("r1"))
    claim_one(spool, "ghost")
    (spool.workers / "ghost.json").write_bytes(b"unreadable")  # counts as no status
    now = time.time()
    assert spool.recover_stale(default_lease_s=10, now=now + 5) == []
    assert spool.recover_stale(default_lease_s=10, now=now + 60) == ["r1.json"]
    assert os.listdir(spool.requests) == ["r1.json"] and os.listdir(spool.claimed) == []


def test_recover_stale_uses_each_workers_own_lease(spool, make_request):
    write_status(spool, "patient", age_s=60, lease_s=120)
    spool.submit(make_request("r1"))
    claim_one(spool, "patient")
    assert spool.recover_stale(default_lease_s=1) == []
    assert spool.recover_stale(default_lease_s=1, now=time.time() + 100) == ["r1.json"]


# -- results for producers -----------------------------------------------------------------------------


def test_read_consume_and_has_result(spool):
    assert spool.read_result("r1") is None and not spool.has_result("r1")
    spool.publish_results([failure("r1", "m")])
    assert spool.has_result("r1")
    assert spool.read_result("r1").error.message == "m"
    spool.consume_result("r1")
    assert os.listdir(spool.results) == []
    assert os.listdir(spool.done) == ["r1.result.json"]
    assert spool.has_result("r1")
    assert spool.read_result("r1").error.message == "m"
    spool.consume_result("r1")  # twice: nothing to move, nothing raised
    spool.consume_result("never")
    assert spool.read_result("never") is None


def test_read_result_reports_a_corrupt_result(spool):
    (spool.results / "r1.json").write_bytes(b'{"request_id": "r1", "ok": tr')
    result = spool.read_result("r1")  # that id's error, not an exception out of a producer's wait
    assert not result.ok and result.error.code is ErrorCode.BAD_RESULT
    assert "results/r1.json" in result.error.message and "not a complete JSON object" in result.error.message


def test_a_result_with_a_field_this_release_does_not_know_fails_naming_it(spool):
    """A worker of a later release (docs/operations.md: upgrade both together) answering with a
    field this reader has not heard of: that id's error names the field; nothing raises or waits."""
    (spool.results / "r1.json").write_bytes(b'{"request_id": "r1", "ok": true, "field_of_tomorrow": [1]}')
    result = spool.read_result("r1")
    assert not result.ok and result.error.code is ErrorCode.BAD_RESULT
    assert "field_of_tomorrow" in result.error.message


def test_locate_finds_every_file_of_an_id(spool, make_request):
    assert spool.locate("r1") == []
    spool.submit(make_request("r1"))
    assert spool.locate("r1") == [spool.requests / "r1.json"]
    claim = claim_one(spool)
    assert spool.locate("r1") == [claim.path]
    spool.publish_results([failure("r1")])
    spool.finish(claim)
    assert spool.locate("r1") == [spool.results / "r1.json", spool.done / "r1.request.json"]
    spool.consume_result("r1")
    assert spool.locate("r1") == [spool.done / "r1.request.json", spool.done / "r1.result.json"]
    (spool.bad / "r1.json").write_bytes(b"")
    assert spool.bad / "r1.json" in spool.locate("r1")
    assert spool.locate("r") == [] and spool.locate("r10") == []


def test_submit_missing_sends_only_ids_the_spool_holds_in_no_state_listing_each_directory_once(
    spool, make_request, monkeypatch
):
    """A producer sending a call again: what is queued, claimed, answered, consumed or in bad/ stays as it is,
    only the rest is published; the check and the submit share one listing of each directory."""
    spool.submit(make_request("claimed"))
    claim_one(spool)
    for request_id in ("answered", "consumed"):
        spool.submit(make_request(request_id))
        claim = claim_one(spool)
        spool.publish_results([failure(request_id)])
        spool.finish(claim)
    spool.consume_result("consumed")
    spool.submit(make_request("queued"))
    (spool.bad / "refused.json").write_bytes(b"")
    held = ["queued", "claimed", "answered", "consumed", "refused"]
    listed: list[str] = []
    listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: (listed.append(Path(path).name), listdir(path))[1])
    sent = spool.submit_missing([make_request(i) for i in ["new1", *held, "new2"]])
    assert [r.request_id for r in sent] == ["new1", "new2"]
    assert sorted(listed) == ["bad", "claimed", "requests", "results"]
    assert sorted(os.listdir(spool.requests)) == ["new1.json", "new2.json", "queued.json"]
    assert spool.submit_missing([make_request("new1")]) == []  # sent already: nothing again


# -- housekeeping --------------------------------------------------------------------------------------


def test_prune_removes_old_done_and_tmp_entries_only(spool):
    now = time.time()
    for directory in (spool.done, spool.tmp, spool.results, spool.requests):
        (directory / "old.json").write_bytes(b"")
    for directory in (spool.done, spool.tmp):
        young = directory / "young.json"
        young.write_bytes(b"")
        os.utime(young, (now + 100, now + 100))  # written "later": max(ctime, mtime) is what counts
    assert spool.prune(done_older_than_s=50, tmp_older_than_s=50, now=now + 10) == {"done": 0, "tmp": 0, "workers": 0}
    assert spool.prune(done_older_than_s=50, tmp_older_than_s=500, now=now + 60) == {"done": 1, "tmp": 0, "workers": 0}
    assert sorted(os.listdir(spool.done)) == ["young.json"]
    assert sorted(os.listdir(spool.tmp)) == ["old.json", "young.json"]
    assert spool.prune(done_older_than_s=50, tmp_older_than_s=500, now=now + 700) == {"done": 1, "tmp": 2, "workers": 0}
    assert os.listdir(spool.done) == [] and os.listdir(spool.tmp) == []
    assert os.listdir(spool.results) == ["old.json"] and os.listdir(spool.requests) == ["old.json"]


def test_prune_removes_status_files_of_long_dead_workers_only(spool):
    now = time.time()
    for worker_id, silent_for in (("gone", 2 * 86400), ("alive", 1)):
        path = spool.workers / f"{worker_id}.json"
        path.write_bytes(b"{}")
        os.utime(path, (now - silent_for, now - silent_for))  # the heartbeat is the mtime
    assert spool.prune(done_older_than_s=10**9, dead_workers_older_than_s=86400, now=now)["workers"] == 1
    assert os.listdir(spool.workers) == ["alive.json"]


def test_entries_by_state(spool, make_request):
    spool.submit_many([make_request("r1"), make_request("r2")])
    assert [e.name for e in spool.entries("requests")] == ["r1.json", "r2.json"]
    assert spool.entries("results") == []
    with pytest.raises(ValueError, match="unknown state 'queue'"):
        spool.entries("queue")


# -- guarantee 1: no reader sees a partial file ---------------------------------------------------------


@pytest.mark.parametrize("state", ["requests", "results", "workers"])
def test_no_reader_ever_sees_a_partial_file(spool, make_request, state):
    big = "x" * 100_000  # far more than one page
    written = 0
    with TornReadReader(spool, [state]) as reader:
        # At least 60 files, and on until the reader has read a good number while writes go on
        # (50 within 300 writes; a reader starved by a loaded machine gets up to 3000 to read 10).
        while written < 60 or (reader.reads < 50 and written < 300) or (reader.reads < 10 and written < 3000):
            if state == "requests":
                spool.submit(make_request(f"r{written}", prompts=[big]))
            elif state == "results":
                spool.publish_results([Result(request_id=f"r{written}", ok=True, texts=[[big]])])
            else:
                spool.write_status(status("w1", last_error=big + str(written)))  # replaced each time
            written += 1
    assert reader.errors == []
    assert reader.reads >= 10, f"the reader read only {reader.reads} files while {written} were written"
    assert os.listdir(spool.tmp) == []


def test_the_torn_read_reader_catches_a_file_written_in_place(spool, make_request, wait_for):
    """The check above can fail: a request written straight into requests/ is seen half-written."""
    data = encode_pretty(make_request("torn", prompts=["x" * 10_000]))
    half = len(data) // 2
    path = spool.requests / "torn.json"
    with TornReadReader(spool, ["requests"]) as reader, open(path, "wb") as f:
        f.write(data[:half])
        f.flush()
        wait_for(lambda: any(f"({half} bytes)" in e for e in reader.errors), what="the half-written file to be seen")
        f.write(data[half:])
    assert all(e.startswith("requests/torn.json (") for e in reader.errors), reader.errors
    assert decode_request(path.read_bytes()).request_id == "torn"


# -- fsio ------------------------------------------------------------------------------------------------


def test_publish_durable_fsyncs_file_and_directory(tmp_path, fsync_spy):
    scratch, final_dir = tmp_path / "tmp", tmp_path / "final"
    scratch.mkdir(), final_dir.mkdir()
    assert fsio.publish(scratch, final_dir / "a.json", b"one") is True
    assert (final_dir / "a.json").read_bytes() == b"one"
    assert fsync_spy == {"files": 1, "dirs": [final_dir]}  # the data, then the name
    # No replace: the existing file wins and nothing new needs syncing the directory.
    assert fsio.publish(scratch, final_dir / "a.json", b"two") is False
    assert (final_dir / "a.json").read_bytes() == b"one"
    assert fsync_spy["dirs"] == [final_dir]
    assert os.listdir(scratch) == []
    assert oct(os.stat(final_dir / "a.json").st_mode & 0o777) == oct(fsio.FILE_MODE & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_publish_non_durable_skips_fsync_and_replace_overwrites(tmp_path, fsync_spy):
    scratch, final_dir = tmp_path / "tmp", tmp_path / "final"
    scratch.mkdir(), final_dir.mkdir()
    assert fsio.publish(scratch, final_dir / "s.json", b"one", replace=True, durable=False) is True
    assert fsio.publish(scratch, final_dir / "s.json", b"two", replace=True, durable=False) is True
    assert (final_dir / "s.json").read_bytes() == b"two"
    assert fsync_spy == {"files": 0, "dirs": []}
    assert os.listdir(scratch) == []


def test_write_synced_never_overwrites_nor_follows_links(tmp_path):
    path = tmp_path / "f"
    fsio.write_synced(path, b"first")
    with pytest.raises(FileExistsError):
        fsio.write_synced(path, b"second")
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError):  # O_EXCL refuses a link, even a dangling one
        fsio.write_synced(tmp_path / "link", b"x")
    assert path.read_bytes() == b"first" and not (tmp_path / "elsewhere").exists()


def test_scratch_names_are_unique():
    assert len({fsio.scratch_name("r1") for _ in range(1000)}) == 1000
    assert fsio.scratch_name("r1").startswith(f"r1.{os.getpid()}.")


# -- guarantee 5: file events are hints --------------------------------------------------------------------


@pytest.mark.parametrize("poll", [False, True])
def test_waker_wakes_on_a_new_file(tmp_path, poll):
    watched = tmp_path / "watched"
    watched.mkdir()
    with Waker([watched], poll=poll, poll_interval_s=0.1) as waker:
        assert waker.polling is poll
        assert waker.wait(0.2) is False  # nothing happened yet
        timer = threading.Timer(0.1, (watched / "new.json").write_bytes, args=(b"{}",))
        timer.start()
        started = time.monotonic()
        assert waker.wait(5.0) is True
        assert time.monotonic() - started < 3.0
        timer.join()


def test_waker_poke_wakes_the_waiter(tmp_path):
    with Waker([tmp_path], poll=False) as waker:
        threading.Timer(0.05, waker.poke).start()
        started = time.monotonic()
        assert waker.wait(5.0) is True
        assert time.monotonic() - started < 3.0
        assert waker.wait(0.05) is False  # the hint was consumed


def test_polling_is_chosen_by_itself_on_network_like_filesystems(request, spool, run_worker, wait_for):
    """inotify sees nothing another host writes; on FUSE (sshfs, bindfs) a worker polls unasked."""
    networked = request.node.callspec.params["storage"] != "local"
    assert needs_polling(spool.requests) is networked
    assert filesystem_type(spool.requests).startswith("fuse") is networked
    handle = run_worker(spool)  # poll=None: the worker decides
    waker = wait_for(lambda: handle.worker._waker, what="the worker's watch")
    assert waker.polling is networked


def test_filesystem_type_is_found_for_any_path(tmp_path):
    assert filesystem_type(tmp_path) != ""
    assert filesystem_type(tmp_path / "not" / "yet" / "there") == filesystem_type(tmp_path)


# -- guarantee 6: every wait has a deadline (client) ------------------------------------------------------


def test_client_wait_returns_results_and_consumes_them(spool, make_request, run_worker):
    run_worker(spool)
    with SpoolClient(spool.root, rescan_s=0.1, no_worker_grace_s=5) as client:
        client.submit(make_request("r1", prompts=["abc"]))
        client.submit_many([make_request("r2"), make_request("r3")])
        results = client.wait(["r1", "r2", "r3"], timeout_s=20)
        assert sorted(results) == ["r1", "r2", "r3"]
        assert all(r.ok for r in results.values())
        assert results["r1"].texts == [["abc", "abc"]]
        assert os.listdir(spool.results) == []
        assert {f"r{i}.result.json" for i in (1, 2, 3)} <= set(os.listdir(spool.done))
        # Consumed results are still found, in done/.
        assert client.wait(["r2"], timeout_s=1)["r2"] == results["r2"]


def test_client_wait_without_consume_leaves_results(spool):
    spool.publish_results([failure("r1")])
    with SpoolClient(spool.root) as client:
        assert client.wait(["r1"], timeout_s=1, consume=False)["r1"].error.code is ErrorCode.ENGINE_ERROR
    assert os.listdir(spool.results) == ["r1.json"]


def test_worker_absence_is_an_error_once_no_worker_was_seen_for_the_grace():
    """The rule `wait` and the trainer's turn batcher share, on given times (no clock)."""
    absence = WorkerAbsence(grace_s=10.0)
    assert not absence.too_long(False, 100.0)  # the first check without a worker starts the grace
    assert not absence.too_long(False, 109.9)
    assert not absence.too_long(True, 110.0)  # a worker came: the grace starts again at the next absence
    assert not absence.too_long(False, 111.0)
    assert not absence.too_long(False, 120.9)
    assert absence.too_long(False, 121.0)
    assert not WorkerAbsence(grace_s=0.0).too_long(False, 5.0)  # one check alone is never an absence


@pytest.mark.parametrize("stale_status", [False, True])
def test_client_learns_quickly_that_no_worker_is_alive(spool, make_request, stale_status):
    if stale_status:
        write_status(spool, "gone", age_s=120, lease_s=30)
    with SpoolClient(spool.root, rescan_s=0.1, no_worker_grace_s=0.5) as client:
        client.submit_many([make_request("r1"), make_request("r2")])
        started = time.monotonic()
        with pytest.raises(NoLiveWorker) as info:
            client.wait(["r1", "r2"], timeout_s=60)
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert info.value.pending == ["r1", "r2"]
    assert "r1 (queued)" in message and "r2 (queued)" in message
    assert f"rollout-svc serve --spool {spool.root}" in message
    assert str(spool.workers) in message


def test_client_times_out_when_a_live_worker_never_answers(spool, make_request):
    write_status(spool, "silent", age_s=0, lease_s=60)
    with SpoolClient(spool.root, rescan_s=0.1, no_worker_grace_s=0.5) as client:
        client.submit_many([make_request("r1"), make_request("r2")])
        spool.claim(next(e for e in spool.pending() if e.name == "r2.json"), "silent")
        started = time.monotonic()
        with pytest.raises(ResultTimeout) as info:
            client.wait(["r1", "r2"], timeout_s=1.0)
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 5
    message = str(info.value)
    assert info.value.pending == ["r1", "r2"]
    assert "r1 (queued)" in message and "r2 (claimed by silent)" in message
    assert "raise the timeout" in message and "spoolctl stats" in message


@pytest.mark.parametrize("recover", [True, False])
def test_client_wait_gives_back_dead_workers_claims(spool, make_request, recover):
    """While it waits, a producer puts claims of dead workers back without relying on a worker
    (once it has watched their heartbeat stand still for half the lease)."""
    write_status(spool, "dead", age_s=60, lease_s=1.0)
    write_status(spool, "silent", age_s=0, lease_s=60)
    spool.submit(make_request("r1"))
    claim_one(spool, "dead")
    with SpoolClient(spool.root, rescan_s=0.1, recover_stale=recover) as client:
        with pytest.raises(ResultTimeout) as info:
            # Recovery can come no sooner than half the lease (0.5 s) after the client's first
            # look; the wait leaves a loaded machine seconds past that to get there.
            client.wait(["r1"], timeout_s=3.0)
    if recover:
        assert os.listdir(spool.requests) == ["r1.json"] and "r1 (queued)" in str(info.value)
    else:
        assert os.listdir(spool.claimed) == ["r1@dead.json"] and "r1 (claimed by dead)" in str(info.value)


def test_client_timeout_message_does_not_claim_live_workers_when_there_are_none(spool, make_request):
    with SpoolClient(spool.root, rescan_s=0.1, no_worker_grace_s=10) as client:
        client.submit(make_request("r1"))
        with pytest.raises((ResultTimeout, NoLiveWorker)) as info:
            client.wait(["r1"], timeout_s=0.3)
    assert "Workers are alive" not in str(info.value)
    assert "rollout-svc serve" in str(info.value)
