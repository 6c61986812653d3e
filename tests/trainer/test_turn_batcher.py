"""TurnBatcher through the real spool, with real echo workers (whose completion of a prompt given
as ids is its first max_tokens ids, so each outcome shows which prompt it answers): turns put
together go out as one request per live worker, at most max_prompts_per_request prompts each and
not before max_wait_s; preferences group turns by worker; every turn comes back once, under its
key; a request held by a dead worker or failed by a transient error is sent again under a fresh
id; a permanent error names the turn; no live worker is an error, not a hang."""

from __future__ import annotations

import os
import time

import pytest
from echo_workers import EchoWorkers
from failing_server import FailingSpoolServer, first

from protocol.client import SpoolClient
from protocol.messages import ErrorCode, WorkerStatus, decode_request
from protocol.spool import Spool
from trainer_svc.rollout.turn_batcher import Turn, TurnBatcher, TurnOutcome
from trainer_svc.rollout_types import RolloutFailed, RolloutUnavailable

MAX_TOKENS = 4


@pytest.fixture
def workers(tmp_path):
    found = EchoWorkers(tmp_path / "spool", tmp_path / "logs")
    yield found
    found.close()


@pytest.fixture
def servers(tmp_path):
    started: list[FailingSpoolServer] = []

    def start(fail, worker_id: str = "failing") -> FailingSpoolServer:
        server = FailingSpoolServer(tmp_path / "spool", None, fail, echo=True, worker_id=worker_id)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        if server.is_alive():
            server.stop()


@pytest.fixture
def batchers(tmp_path):
    made: list[TurnBatcher] = []

    def make(grace_s: float = 30.0, **options) -> TurnBatcher:
        client = SpoolClient(tmp_path / "spool", no_worker_grace_s=grace_s)
        fields = dict(weights_dir="/models/none", weights_content_id=None, max_tokens=MAX_TOKENS)
        batcher = TurnBatcher(client, **(fields | dict(temperature=1.0, top_p=1.0, stop=[]) | options))
        made.append(batcher)
        return batcher

    yield make
    for batcher in made:
        batcher.close()
        batcher.client.close()


def prompt(i: int) -> list[int]:
    return [0x41 + i % 26, 0x61 + i % 26, 0x30 + i % 10] + [0x2B] * (i % 4)


def turn(i: int, prefer: str | None = None, episode: str = "ep") -> Turn:
    return Turn(f"{episode}{i}.t0", prompt(i), seed=i, prefer_worker=prefer)


def drain(batcher: TurnBatcher, timeout_s: float = 60.0) -> dict[str, TurnOutcome]:
    outcomes: dict[str, TurnOutcome] = {}
    deadline = time.monotonic() + timeout_s
    while batcher.pending():
        assert time.monotonic() < deadline, f"{batcher.pending()} turns never came back"
        for outcome in batcher.poll(1.0):
            assert outcome.key not in outcomes, f"{outcome.key} came back twice"
            outcomes[outcome.key] = outcome
    return outcomes


def seeds_of(request) -> list[int]:
    """The seeds a request carries: the turns' indices, as `turn` seeds them."""
    return list(request.prompt_seeds)


def archived_requests(spool_dir, dead_claims: int = 0, timeout_s: float = 30.0) -> list:
    """The requests served, once the workers have archived them (a worker publishes a result,
    then archives its request); `dead_claims`: claims of dead workers, never archived."""
    spool = Spool(spool_dir)
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(spool.claimed)) > dead_claims or os.listdir(spool.requests):
        assert time.monotonic() < deadline, "requests still pending or claimed"
        time.sleep(0.05)
    return [decode_request(p.read_bytes()) for p in sorted(spool.done.glob("*.request.json"))]


def assert_echoed(outcomes: dict[str, TurnOutcome], indices) -> None:
    assert sorted(outcomes) == sorted(f"ep{i}.t0" for i in indices)
    for i in indices:
        outcome = outcomes[f"ep{i}.t0"]
        expected = prompt(i)[:MAX_TOKENS]
        assert outcome.token_ids == expected and outcome.text == "".join(map(chr, expected))
        assert outcome.logprobs == [0.0] * len(expected)
        assert outcome.finish_reason == ("length" if len(prompt(i)) > MAX_TOKENS else "stop")


def test_turns_put_together_go_out_as_one_request_per_live_worker(tmp_path, workers, batchers):
    workers.start("echo-a")
    workers.start("echo-b")
    batcher = batchers(max_wait_s=0.0)
    for i in range(40):
        batcher.put(turn(i))
    assert batcher.pending() == 40
    outcomes = drain(batcher)
    assert_echoed(outcomes, range(40))
    assert batcher.requests_sent == 2 and batcher.turns_sent == 40
    requests = archived_requests(tmp_path / "spool")
    assert [len(r.prompt_token_ids) for r in requests] == [20, 20]  # spread evenly
    assert all(r.n_samples_per_prompt == 1 and r.logprobs for r in requests)
    assert sorted(r.prefer_worker for r in requests) == ["echo-a", "echo-b"]  # and each served by its target
    served_by = {o.key: o.worker_id for o in outcomes.values()}
    assert all(served_by[f"ep{i}.t0"] == r.prefer_worker for r in requests for i in seeds_of(r))


def test_a_request_carries_at_most_max_prompts_per_request_in_even_parts(tmp_path, workers, batchers):
    workers.start("echo-a")
    batcher = batchers(max_wait_s=0.0, max_prompts_per_request=4)
    for i in range(10):
        batcher.put(turn(i))
    assert_echoed(drain(batcher), range(10))
    assert sorted(len(r.prompt_token_ids) for r in archived_requests(tmp_path / "spool")) == [3, 3, 4]


def test_queued_turns_wait_for_max_wait_s_unless_a_request_is_full(tmp_path, workers, batchers):
    workers.start("echo-a")
    batcher = batchers(max_wait_s=3600.0, max_prompts_per_request=4)
    for i in range(3):
        batcher.put(turn(i))
    assert batcher.poll(0.3) == []
    assert batcher.requests_sent == 0 and os.listdir(tmp_path / "spool" / "requests") == []
    batcher.put(turn(3))  # the fourth fills a request: it goes now
    assert_echoed(drain(batcher), range(4))
    assert batcher.requests_sent == 1


def test_turns_go_to_their_live_preferred_worker_and_the_others_spread_over_the_least_loaded(
    tmp_path, workers, batchers
):
    workers.start("echo-a")
    workers.start("echo-b")
    batcher = batchers(max_wait_s=0.0)
    indices = range(12)
    for i in indices:
        # 6 prefer echo-a; 2 have no preference; 4 prefer a worker that does not exist
        batcher.put(turn(i, "echo-a" if i < 6 else None if i < 8 else "gone"))
    outcomes = drain(batcher)
    assert_echoed(outcomes, indices)
    # echo-a holds 6, so the 6 others fill echo-b up to it: one request per worker
    requests = {r.prefer_worker: r for r in archived_requests(tmp_path / "spool")}
    assert sorted(requests) == ["echo-a", "echo-b"]
    assert seeds_of(requests["echo-a"]) == list(range(6)) and seeds_of(requests["echo-b"]) == list(range(6, 12))
    assert {outcomes[f"ep{i}.t0"].worker_id for i in range(6)} == {"echo-a"}
    assert {outcomes[f"ep{i}.t0"].worker_id for i in range(6, 12)} == {"echo-b"}


def test_turns_without_a_seed_travel_unseeded_in_requests_of_their_own(tmp_path, workers, batchers):
    workers.start("echo-a")
    batcher = batchers(max_wait_s=0.0)
    batcher.put(turn(0))
    batcher.put(Turn("free.t0", prompt(1), seed=None, prefer_worker=None))
    batcher.put(turn(2))
    outcomes = drain(batcher)
    assert outcomes["free.t0"].token_ids == prompt(1)[:MAX_TOKENS]
    sent = sorted((r.prompt_seeds or [], r.seed) for r in archived_requests(tmp_path / "spool"))
    assert sent == [([], None), ([0, 2], None)]


def test_turns_keep_the_weights_they_were_put_with(tmp_path, workers, batchers):
    workers.start("echo-a")
    batcher = batchers(max_wait_s=3600.0, max_prompts_per_request=3)
    batcher.put(turn(0))
    batcher.set_weights("/models/next", "content-2")
    batcher.put(turn(1))
    batcher.put(turn(2))  # three queued: they go now, one request per weights
    assert_echoed(drain(batcher), range(3))
    sent = {
        r.weights_dir: (r.weights_content_id, len(r.prompt_token_ids)) for r in archived_requests(tmp_path / "spool")
    }
    assert sent == {"/models/none": (None, 1), "/models/next": ("content-2", 2)}


def test_turns_of_another_temperature_travel_in_requests_of_their_own(tmp_path, workers, batchers):
    workers.start("echo-a")
    batcher = batchers(max_wait_s=0.0)  # the batcher's own temperature: 1.0
    batcher.put(turn(0))
    batcher.put(Turn("greedy1.t0", prompt(1), seed=1, prefer_worker=None, temperature=0.0))
    batcher.put(turn(2))
    batcher.put(Turn("greedy3.t0", prompt(3), seed=3, prefer_worker=None, temperature=0.0))
    outcomes = drain(batcher)
    assert outcomes["greedy3.t0"].token_ids == prompt(3)[:MAX_TOKENS]
    sent = sorted((r.temperature, r.prompt_seeds) for r in archived_requests(tmp_path / "spool"))
    assert sent == [(0.0, [1, 3]), (1.0, [0, 2])]


def test_a_request_held_by_a_dead_worker_is_sent_again_under_a_fresh_id(tmp_path, workers, batchers):
    spool = Spool(tmp_path / "spool", create=True)
    now = time.time()
    ghost = WorkerStatus(
        worker_id="ghost", pid=1, host="elsewhere", device="cpu", engine="echo", state="generating",
        lease_s=30.0, started_at=now - 7200, heartbeat_at=now - 3600,
    )  # fmt: skip
    spool.write_status(ghost)  # a worker that claimed a request, then was killed an hour ago
    os.utime(spool.status_path("ghost"), (now - 3600, now - 3600))
    batcher = batchers(max_wait_s=0.0)
    batcher.put(turn(0))
    batcher.put(turn(1))
    assert batcher.poll(0.0) == []
    (entry,) = spool.pending()
    assert spool.claim(entry, "ghost") is not None
    workers.start("echo-b")
    outcomes = drain(batcher)
    assert_echoed(outcomes, range(2))
    assert {o.worker_id for o in outcomes.values()} == {"echo-b"}
    assert batcher.resent == 1 and batcher.requests_sent == 2
    assert [c.name for c in spool.entries("claimed")] == [spool.claim_path(entry.name, "ghost").name]  # not served
    (served,) = archived_requests(tmp_path / "spool", dead_claims=1)
    assert served.request_id != entry.name.removesuffix(".json")


def test_a_transient_error_is_sent_again_under_a_fresh_id(tmp_path, servers, batchers):
    server = servers(first(1, ErrorCode.ENGINE_ERROR))
    batcher = batchers(max_wait_s=0.0)
    for i in range(3):
        batcher.put(turn(i))
    assert_echoed(drain(batcher), range(3))
    failed, again = server.answered
    assert server.failed == [failed] and again != failed and batcher.resent == 1


def test_transient_errors_are_sent_again_at_most_error_retries_times(tmp_path, servers, batchers):
    server = servers(lambda request: ErrorCode.ENGINE_ERROR)
    batcher = batchers(max_wait_s=0.0, error_retries=2)
    batcher.put(turn(0))
    with pytest.raises(RolloutUnavailable) as info:
        drain(batcher)
    assert len(server.failed) == 3 and len(set(server.failed)) == 3
    assert "ep0.t0" in str(info.value) and "3 times" in str(info.value) and "engine_error" in str(info.value)


def test_a_permanent_error_raises_naming_the_turn_and_the_error(tmp_path, servers, batchers):
    server = servers(lambda request: ErrorCode.WEIGHTS_NOT_ALLOWED)
    batcher = batchers(max_wait_s=0.0)
    batcher.put(turn(0, episode="row3-ep"))
    with pytest.raises(RolloutFailed) as info:
        drain(batcher)
    assert len(server.failed) == 1  # never sent again: it would fail the same way
    message = str(info.value)
    assert "row3-ep0.t0" in message and "weights_not_allowed made by the test" in message and "permanent" in message


def test_no_live_worker_is_an_error_naming_what_waits(tmp_path, batchers):
    batcher = batchers(grace_s=0.0, max_wait_s=0.0)
    batcher.put(turn(0))
    with pytest.raises(RolloutUnavailable) as info:
        batcher.poll(30.0)
    assert "no live rollout worker" in str(info.value) and "1 turns wait" in str(info.value)


def test_a_key_already_pending_is_refused(batchers):
    batcher = batchers()
    batcher.put(turn(0))
    with pytest.raises(ValueError, match="ep0.t0"):
        batcher.put(turn(0))
    with pytest.raises(ValueError, match="non-empty"):
        batcher.put(Turn("empty.t0", [], seed=None, prefer_worker=None))
