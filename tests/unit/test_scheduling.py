"""Scheduler.pick: loaded weights first, aging, requests to answer at once, batch limits, the
share of a call's parts left to idle peers, and the peek that reads request files before they are
claimed."""

from __future__ import annotations

import os
import time

import pytest

from protocol.messages import WorkerStatus, encode
from protocol.spool import MAX_REQUEST_BYTES, Spool
from rollout_svc.scheduling import Limits, Scheduler, weights_key

BASE = 1_700_000_000.0  # request files get mtimes BASE, BASE + 1, ...; `now` is passed explicitly


def put(spool: Spool, request, age_rank: int) -> None:
    """Write `request` into requests/ with mtime BASE + age_rank (lower rank: older)."""
    path = spool.requests / f"{request.request_id}.json"
    path.write_bytes(encode(request))
    set_mtime(path, BASE + age_rank)


def put_raw(spool: Spool, name: str, data: bytes, age_rank: int) -> None:
    path = spool.requests / name
    path.write_bytes(data)
    set_mtime(path, BASE + age_rank)


def set_mtime(path, t: float) -> None:
    ns = int(t * 1e9)
    os.utime(path, ns=(ns, ns), follow_symlinks=False)


def names(entries) -> list[str]:
    return [e.name for e in entries]


DEFAULT_LIMITS = Limits()


def pick(spool: Spool, loaded=None, now=BASE + 10, limits: Limits = DEFAULT_LIMITS, scheduler=None):
    scheduler = scheduler or Scheduler(spool, limits)
    return names(scheduler.pick(spool.pending(), loaded, now=now))


# -- weights preference and aging ----------------------------------------------------------------


def test_without_loaded_weights_the_oldest_request_sets_the_weights(spool, make_request):
    put(spool, make_request("a1", weights_dir="/m/a"), 0)
    put(spool, make_request("b1", weights_dir="/m/b"), 1)
    put(spool, make_request("a2", weights_dir="/m/a"), 2)
    assert pick(spool, loaded=None) == ["a1.json", "a2.json"]


def test_requests_for_the_loaded_weights_come_first(spool, make_request):
    put(spool, make_request("a1", weights_dir="/m/a"), 0)
    put(spool, make_request("b1", weights_dir="/m/b"), 1)
    put(spool, make_request("a2", weights_dir="/m/a"), 2)
    put(spool, make_request("b2", weights_dir="/m/b"), 3)
    assert pick(spool, loaded="/m/b") == ["b1.json", "b2.json"]


def test_loaded_weights_nobody_asks_for_fall_back_to_the_oldest(spool, make_request):
    put(spool, make_request("a1", weights_dir="/m/a"), 0)
    put(spool, make_request("b1", weights_dir="/m/b"), 1)
    assert pick(spool, loaded="/m/c") == ["a1.json"]


def test_an_oldest_request_past_max_wait_wins_whatever_its_weights(spool, make_request):
    put(spool, make_request("a1", weights_dir="/m/a"), 0)
    put(spool, make_request("b1", weights_dir="/m/b"), 1)
    limits = Limits(max_wait_s=60.0)
    assert pick(spool, loaded="/m/b", now=BASE + 59.5, limits=limits) == ["b1.json"]
    assert pick(spool, loaded="/m/b", now=BASE + 60.5, limits=limits) == ["a1.json"]


def test_aging_follows_the_file_mtime(spool, make_request):
    """The age is the request file's mtime, as a producer's write sets it."""
    put(spool, make_request("a1", weights_dir="/m/a"), 0)
    put(spool, make_request("b1", weights_dir="/m/b"), 1)
    limits = Limits(max_wait_s=5.0)
    assert pick(spool, loaded="/m/b", now=BASE + 4, limits=limits) == ["b1.json"]
    set_mtime(spool.requests / "a1.json", BASE - 100)
    assert pick(spool, loaded="/m/b", now=BASE + 4, limits=limits) == ["a1.json"]


def test_the_default_now_is_the_clock(spool, make_request):
    put(spool, make_request("a1", weights_dir="/m/a"), 0)  # mtime in 2023: far past max_wait
    put(spool, make_request("b1", weights_dir="/m/b"), 1)
    assert names(Scheduler(spool).pick(spool.pending(), "/m/b")) == ["a1.json"]


# -- requests answered at once -------------------------------------------------------------------


@pytest.mark.parametrize(
    "case", ["not_json", "bad_name", "empty", "directory", "huge", "invalid_field", "unknown_schema"]
)
def test_unacceptable_files_are_picked_first(spool, make_request, case, tmp_path):
    put(spool, make_request("ok1", weights_dir="/m/a"), 0)
    name = f"{case}.json"
    if case == "not_json":
        put_raw(spool, name, b"{not json", 1)
    elif case == "bad_name":
        name = "bad name.json"
        put_raw(spool, name, encode(make_request("ok2")), 1)
    elif case == "empty":
        put_raw(spool, name, b"", 1)
    elif case == "directory":
        (spool.requests / name).mkdir()
        set_mtime(spool.requests / name, BASE + 1)
    elif case == "huge":
        with open(spool.requests / name, "wb") as f:
            f.write(encode(make_request("huge"))[:-1])
            f.truncate(MAX_REQUEST_BYTES + 1)
        set_mtime(spool.requests / name, BASE + 1)
    elif case == "invalid_field":
        put_raw(spool, name, encode(make_request(case)).replace(b'"max_tokens":5', b'"max_tokens":0'), 1)
    elif case == "unknown_schema":
        put_raw(spool, name, encode(make_request(case, schema=99)), 1)
    put(spool, make_request("ok2", weights_dir="/m/a"), 2)
    assert pick(spool, loaded="/m/a") == [name]


def test_expired_deadlines_are_picked_first_and_future_ones_are_not(spool, make_request):
    put(spool, make_request("a1", weights_dir="/m/a"), 0)
    put(spool, make_request("late", weights_dir="/m/b", deadline=BASE + 5), 1)
    put(spool, make_request("soon", weights_dir="/m/b", deadline=BASE + 50), 2)
    assert pick(spool, loaded="/m/a", now=BASE + 10) == ["late.json"]
    assert pick(spool, loaded="/m/a", now=BASE + 4) == ["a1.json"]


def test_every_request_to_answer_now_is_picked_oldest_first_up_to_max_requests(spool, make_request):
    put(spool, make_request("a1"), 0)
    put_raw(spool, "x1.json", b"[]", 1)
    put(spool, make_request("late", deadline=BASE), 2)
    put_raw(spool, "x2.json", b"nope", 3)
    assert pick(spool) == ["x1.json", "late.json", "x2.json"]
    assert pick(spool, limits=Limits(max_requests=2)) == ["x1.json", "late.json"]


def test_a_symlink_to_a_valid_request_is_never_followed(spool, make_request, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "link.json"
    target.write_bytes(encode(make_request("link", weights_dir="/m/a")))
    put(spool, make_request("a1", weights_dir="/m/a"), 0)
    os.symlink(target, spool.requests / "link.json")
    set_mtime(spool.requests / "link.json", BASE + 1)
    put(spool, make_request("a2", weights_dir="/m/a"), 2)
    assert pick(spool, loaded="/m/a") == ["link.json"]


def test_a_dangling_symlink_is_answered_now(spool, make_request, tmp_path):
    put(spool, make_request("a1"), 0)
    os.symlink(tmp_path / "missing.json", spool.requests / "gone.json")
    set_mtime(spool.requests / "gone.json", BASE + 1)
    assert pick(spool) == ["gone.json"]


def test_a_request_whose_id_differs_from_its_name_is_answered_now(spool, make_request):
    put(spool, make_request("a1", weights_dir="/m/a"), 0)
    put_raw(spool, "named.json", encode(make_request("other", weights_dir="/m/b")), 1)
    assert pick(spool, loaded="/m/a") == ["named.json"]


# -- batches -------------------------------------------------------------------------------------


def test_a_batch_shares_one_weights_key_content_id_included(spool, make_request):
    put(spool, make_request("a1", weights_dir="/m/a", weights_content_id="v1"), 0)
    put(spool, make_request("a2", weights_dir="/m/a", weights_content_id="v2"), 1)
    put(spool, make_request("b1", weights_dir="/m/b"), 2)
    put(spool, make_request("a3", weights_dir="/m/a", weights_content_id="v1"), 3)
    put(spool, make_request("a4", weights_dir="/m/a"), 4)
    assert pick(spool) == ["a1.json", "a3.json"]
    # With /m/a loaded, the first request naming it sets the content id too.
    put(spool, make_request("a0", weights_dir="/m/a", weights_content_id="v2"), -1)
    assert pick(spool, loaded="/m/a") == ["a0.json", "a2.json"]


def test_weights_key(make_request):
    assert weights_key(make_request(weights_dir="/m/a")) == ("/m/a", None)
    assert weights_key(make_request(weights_dir="/m/a", weights_content_id="c")) == ("/m/a", "c")


def test_max_requests_keeps_the_oldest(spool, make_request):
    for i in range(5):
        put(spool, make_request(f"a{i}"), i)
    assert pick(spool, limits=Limits(max_requests=2)) == ["a0.json", "a1.json"]
    assert pick(spool, limits=Limits(max_requests=5)) == [f"a{i}.json" for i in range(5)]


def test_max_sequences_counts_prompts_times_samples(spool, make_request):
    for i in range(3):  # 2 prompts x 2 samples: 4 sequences each
        put(spool, make_request(f"a{i}", prompts=["p", "q"], n_samples_per_prompt=2), i)
    assert pick(spool, limits=Limits(max_sequences=11)) == ["a0.json", "a1.json"]
    assert pick(spool, limits=Limits(max_sequences=12)) == ["a0.json", "a1.json", "a2.json"]
    assert pick(spool, limits=Limits(max_sequences=4)) == ["a0.json"]


def test_a_request_larger_than_max_sequences_is_picked_alone(spool, make_request):
    put(spool, make_request("big", prompts=["p"] * 3, n_samples_per_prompt=4), 0)  # 12 sequences
    put(spool, make_request("small", n_samples_per_prompt=1), 1)
    assert pick(spool, limits=Limits(max_sequences=10)) == ["big.json"]


def test_a_large_request_behind_a_small_one_waits_for_the_next_batch(spool, make_request):
    put(spool, make_request("small", n_samples_per_prompt=1), 0)
    put(spool, make_request("big", prompts=["p"] * 3, n_samples_per_prompt=4), 1)
    put(spool, make_request("small2", n_samples_per_prompt=1), 2)
    limits = Limits(max_sequences=10)
    assert pick(spool, limits=limits) == ["small.json"]  # the batch keeps the queue order
    os.unlink(spool.requests / "small.json")
    assert pick(spool, limits=limits) == ["big.json"]


# -- the peek cache ------------------------------------------------------------------------------


def test_a_replaced_file_is_read_again_when_its_mtime_changes(spool, make_request):
    put(spool, make_request("x", weights_dir="/m/a"), 0)
    put(spool, make_request("y", weights_dir="/m/b"), 1)
    scheduler = Scheduler(spool)
    assert pick(spool, scheduler=scheduler) == ["x.json"]
    before = (spool.requests / "x.json").stat().st_size
    put(spool, make_request("x", weights_dir="/m/b"), 0)  # same size, then a new mtime
    assert (spool.requests / "x.json").stat().st_size == before
    set_mtime(spool.requests / "x.json", BASE + 0.5)
    assert pick(spool, scheduler=scheduler) == ["x.json", "y.json"]


def test_a_replaced_file_is_read_again_when_its_size_changes(spool, make_request):
    put(spool, make_request("x", weights_dir="/m/a"), 0)
    put(spool, make_request("y", weights_dir="/m/b"), 1)
    scheduler = Scheduler(spool)
    assert pick(spool, scheduler=scheduler) == ["x.json"]
    put(spool, make_request("x", weights_dir="/m/b", tag="longer now"), 0)  # same mtime
    assert pick(spool, scheduler=scheduler) == ["x.json", "y.json"]


def test_a_file_that_becomes_valid_is_read_again(spool, make_request):
    put_raw(spool, "x.json", b"{", 0)
    put(spool, make_request("y", weights_dir="/m/b"), 1)
    scheduler = Scheduler(spool)
    assert pick(spool, scheduler=scheduler) == ["x.json"]
    put(spool, make_request("x", weights_dir="/m/b"), 0)
    assert pick(spool, scheduler=scheduler) == ["x.json", "y.json"]


def test_a_valid_file_replaced_by_a_symlink_is_not_served_from_the_cache(spool, make_request, tmp_path):
    request = make_request("x", weights_dir="/m/a")
    put(spool, request, 0)
    put(spool, make_request("y", weights_dir="/m/a"), 1)
    scheduler = Scheduler(spool)
    assert pick(spool, scheduler=scheduler) == ["x.json", "y.json"]
    target = tmp_path / "target.json"
    target.write_bytes(encode(request))
    os.unlink(spool.requests / "x.json")
    os.symlink(target, spool.requests / "x.json")
    set_mtime(spool.requests / "x.json", BASE)
    assert pick(spool, scheduler=scheduler) == ["x.json"]


def test_pick_reads_each_unchanged_file_once(spool, make_request, monkeypatch):
    import rollout_svc.scheduling as scheduling

    put(spool, make_request("a1"), 0)
    put(spool, make_request("a2"), 1)
    reads = []
    real = scheduling.read_regular_file
    monkeypatch.setattr(
        scheduling, "read_regular_file", lambda path, limit: reads.append(path.name) or real(path, limit)
    )
    scheduler = Scheduler(spool)
    for _ in range(3):
        assert pick(spool, scheduler=scheduler) == ["a1.json", "a2.json"]
    assert sorted(reads) == ["a1.json", "a2.json"]


# -- the parts of a call go to different idle workers -------------------------------------------


def peer(spool: Spool, worker_id: str, state: str = "idle", *, heartbeat_age_s: float = 0.0) -> None:
    """A status file in workers/, as a worker writes it; `heartbeat_age_s` backdates its mtime."""
    now = time.time()
    status = WorkerStatus(
        worker_id=worker_id, pid=1, host="h", device="cpu", engine="echo", state=state,
        lease_s=30.0, started_at=now, heartbeat_at=now - heartbeat_age_s,
    )  # fmt: skip
    spool.write_status(status)
    set_mtime(spool.status_path(worker_id), now - heartbeat_age_s)


def put_call(spool: Spool, make_request, call_id: str | None, parts: int, first_rank: int = 0) -> None:
    for part in range(parts):
        put(spool, make_request(f"{call_id}-p{part}", call_id=call_id), first_rank + part)


def pick_as(spool: Spool, worker_id: str = "me", scheduler=None) -> list[str]:
    scheduler = scheduler or Scheduler(spool)
    return names(scheduler.pick(spool.pending(), None, now=BASE + 10, worker_id=worker_id))


def test_a_worker_leaves_the_other_part_of_a_two_part_call_to_an_idle_peer(spool, make_request):
    put_call(spool, make_request, "c", 2)
    peer(spool, "me")  # its own status: never a peer
    assert pick_as(spool) == ["c-p0.json", "c-p1.json"]
    peer(spool, "other")
    assert pick_as(spool) == ["c-p0.json"]
    assert pick_as(spool, "other") == ["c-p0.json"]  # each takes one; a lost claim means a rescan


@pytest.mark.parametrize("state", ["idle", "sleeping"])
def test_a_sleeping_peer_counts_as_idle(spool, make_request, state):
    put_call(spool, make_request, "c", 2)
    peer(spool, "other", state)
    assert pick_as(spool) == ["c-p0.json"]


@pytest.mark.parametrize("state", ["starting", "loading", "generating", "reloading", "stopping"])
def test_a_peer_that_cannot_take_a_request_now_leaves_the_whole_call(spool, make_request, state):
    put_call(spool, make_request, "c", 2)
    peer(spool, "other", state)
    assert pick_as(spool) == ["c-p0.json", "c-p1.json"]


def test_a_peer_whose_heartbeat_is_older_than_its_lease_leaves_the_whole_call(spool, make_request):
    put_call(spool, make_request, "c", 2)
    peer(spool, "gone", heartbeat_age_s=3600)
    assert pick_as(spool) == ["c-p0.json", "c-p1.json"]


def test_an_unreadable_status_file_is_no_idle_peer(spool, make_request):
    put_call(spool, make_request, "c", 2)
    (spool.workers / "torn.json").write_bytes(b'{"worker_id": "torn", "st')
    assert pick_as(spool) == ["c-p0.json", "c-p1.json"]


@pytest.mark.parametrize(("parts", "idle_peers", "share"), [(5, 1, 3), (5, 2, 2), (4, 1, 2), (3, 5, 1), (4, 0, 4)])
def test_a_worker_takes_its_share_of_a_call_rounded_up(spool, make_request, parts, idle_peers, share):
    put_call(spool, make_request, "c", parts)
    for i in range(idle_peers):
        peer(spool, f"idle{i}")
    peer(spool, "busy", "generating")
    assert pick_as(spool) == [f"c-p{i}.json" for i in range(share)]


@pytest.mark.parametrize(("parts", "ghosts", "share"), [(2, 1, 1), (4, 1, 2), (8, 7, 1), (5, 2, 2)])
def test_parts_left_pending_after_a_share_are_all_taken_at_the_next_pick(spool, make_request, parts, ghosts, share):
    """Peers that look idle but never come (frozen, or killed, within their lease) delay the
    parts left to them by one engine call of this worker, never more: the next pick takes them all."""
    put_call(spool, make_request, "c", parts)
    for i in range(ghosts):
        peer(spool, f"frozen{i}")
    scheduler = Scheduler(spool)
    first = pick_as(spool, scheduler=scheduler)
    assert first == [f"c-p{i}.json" for i in range(share)]
    for name in first:
        os.unlink(spool.requests / name)  # claimed and served
    scheduler.served(["c"])
    assert pick_as(spool, scheduler=scheduler) == [f"c-p{i}.json" for i in range(share, parts)]


def test_a_claim_lost_to_a_faster_peer_leaves_the_share_rule_as_it_was(spool, make_request):
    put_call(spool, make_request, "c", 4)
    for i in range(3):
        peer(spool, f"idle{i}")
    scheduler = Scheduler(spool)
    assert pick_as(spool, scheduler=scheduler) == ["c-p0.json"]
    os.unlink(spool.requests / "c-p0.json")  # a peer claimed it first: this worker serves nothing of c
    peer(spool, "idle0", "generating")
    assert pick_as(spool, scheduler=scheduler) == ["c-p1.json"]  # its share among the two idle peers left


def test_a_call_is_forgotten_once_none_of_its_parts_is_pending(spool, make_request):
    put_call(spool, make_request, "c", 2)
    peer(spool, "other")
    scheduler = Scheduler(spool)
    assert pick_as(spool, scheduler=scheduler) == ["c-p0.json"]
    scheduler.served(["c"])
    for name in ("c-p0.json", "c-p1.json"):
        os.unlink(spool.requests / name)  # both served, one by the peer
    assert pick_as(spool, scheduler=scheduler) == []
    put_call(spool, make_request, "c", 2)  # a call id used again (a relaunch) is shared afresh
    assert pick_as(spool, scheduler=scheduler) == ["c-p0.json"]


def test_each_call_is_shared_on_its_own_and_requests_without_a_call_batch_as_before(spool, make_request):
    put_call(spool, make_request, "x", 2, first_rank=0)
    put(spool, make_request("alone1"), 2)
    put_call(spool, make_request, "y", 3, first_rank=3)
    put(spool, make_request("alone2"), 6)
    peer(spool, "other")
    assert pick_as(spool) == ["x-p0.json", "alone1.json", "y-p0.json", "y-p1.json", "alone2.json"]


def test_calls_of_one_part_read_no_status_file(spool, make_request, monkeypatch):
    import protocol.spool_liveness as liveness

    reads = []
    real = liveness.fsio.read_regular_file
    monkeypatch.setattr(liveness.fsio, "read_regular_file", lambda p, limit: reads.append(p.name) or real(p, limit))
    for i in range(3):
        put(spool, make_request(f"single{i}", call_id=f"call{i}"), i)
    put(spool, make_request("plain"), 3)
    peer(spool, "other")
    assert pick_as(spool) == ["single0.json", "single1.json", "single2.json", "plain.json"]
    assert reads == []


def test_status_files_are_read_only_until_enough_idle_peers_are_found(spool, make_request, monkeypatch):
    import protocol.spool_liveness as liveness

    reads = []
    real = liveness.fsio.read_regular_file
    monkeypatch.setattr(liveness.fsio, "read_regular_file", lambda p, limit: reads.append(p.name) or real(p, limit))
    for i in range(20):
        peer(spool, f"idle{i}")
    put_call(spool, make_request, "c", 3)
    assert pick_as(spool) == ["c-p0.json"]
    assert len(reads) == 2  # two idle peers bring a three-part call down to one part each


# -- a request preferring a worker is left to it while it lives, for sticky_wait_s at most ------------


def pick_sticky(spool: Spool, now: float, worker_id: str = "me", sticky_wait_s: float = 2.0, scheduler=None):
    scheduler = scheduler or Scheduler(spool, Limits(sticky_wait_s=sticky_wait_s))
    return names(scheduler.pick(spool.pending(), None, now=now, worker_id=worker_id)), scheduler.next_sticky_s


def test_a_request_preferring_a_live_peer_is_left_to_it_until_the_sticky_wait_is_over(spool, make_request):
    peer(spool, "other", "generating")  # alive but busy
    put(spool, make_request("theirs", prefer_worker="other"), 0)
    put(spool, make_request("anyone"), 1)
    picked, next_sticky = pick_sticky(spool, now=BASE + 0.5)
    assert picked == ["anyone.json"] and next_sticky == pytest.approx(1.5)
    assert pick_sticky(spool, now=BASE + 2.0)[0] == ["theirs.json", "anyone.json"]  # never starved
    assert pick_sticky(spool, now=BASE + 0.5, worker_id="other")[0] == ["theirs.json", "anyone.json"]


def test_a_pick_with_only_requests_left_to_peers_is_empty_and_says_when_to_look_again(spool, make_request):
    peer(spool, "other")
    put(spool, make_request("theirs", prefer_worker="other"), 0)
    put(spool, make_request("theirs-too", prefer_worker="other"), 1)
    assert pick_sticky(spool, now=BASE + 1.25) == ([], pytest.approx(0.75))


@pytest.mark.parametrize("how", ["dead", "absent", "unreadable"])
def test_a_request_preferring_a_dead_or_absent_worker_is_taken_at_once(spool, make_request, how):
    if how == "dead":
        peer(spool, "other", heartbeat_age_s=3600)
    elif how == "unreadable":
        (spool.workers / "other.json").write_bytes(b'{"worker_id": "other", "st')
    put(spool, make_request("theirs", prefer_worker="other"), 0)
    assert pick_sticky(spool, now=BASE + 0.1) == (["theirs.json"], None)


def test_the_preferred_worker_serves_its_requests_before_the_older_others(spool, make_request):
    peer(spool, "other")
    put(spool, make_request("old"), 0)
    put(spool, make_request("mine", prefer_worker="me"), 1)
    put(spool, make_request("theirs", prefer_worker="other"), 2)
    limits = Limits(max_requests=1)
    scheduler = Scheduler(spool, limits)
    assert names(scheduler.pick(spool.pending(), None, now=BASE + 2.1, worker_id="me")) == ["mine.json"]


def test_a_zero_sticky_wait_leaves_nothing_to_peers(spool, make_request):
    peer(spool, "other")
    put(spool, make_request("theirs", prefer_worker="other"), 0)
    assert pick_sticky(spool, now=BASE, sticky_wait_s=0.0) == (["theirs.json"], None)


def test_requests_without_a_preference_for_a_peer_read_no_status_file(spool, make_request, monkeypatch):
    peer(spool, "other")
    put(spool, make_request("anyone"), 0)
    put(spool, make_request("mine", prefer_worker="me"), 1)
    monkeypatch.setattr(Spool, "live_workers", lambda self, now=None: pytest.fail("status files read"))
    assert pick_sticky(spool, now=BASE + 0.1)[0] == ["mine.json", "anyone.json"]
