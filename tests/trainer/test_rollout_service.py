"""The trainer's side of the spool with real echo workers (no model: the spool mechanics alone):
fan-out over the live workers, calls taken over by a relaunch without sending anything twice,
a timeout that says where each request stands, and error results: a transient one is sent again
under a fresh id (a bounded number of times), a permanent one stops the call with what to do, and
a relaunch never stops on an error result an earlier launch got."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import make_config
from echo_workers import EchoWorkers
from failing_server import FailingSpoolServer, first

from protocol.messages import ErrorCode, Result
from protocol.spool import Spool
from trainer_svc.rollout.client import RolloutService
from trainer_svc.rollout_types import RolloutFailed, RolloutUnavailable, Ticket, WeightsRef

WEIGHTS = WeightsRef("/models/none", None, 3)  # the echo engine loads nothing


@pytest.fixture
def workers(tmp_path):
    found = EchoWorkers(tmp_path / "spool", tmp_path / "logs")
    yield found
    found.close()


def archived(spool: Spool, timeout_s: float = 30.0) -> None:
    """Until the workers have archived every claim: a worker publishes a result, then archives."""
    deadline = time.monotonic() + timeout_s
    while os.listdir(spool.claimed) and time.monotonic() < deadline:
        time.sleep(0.05)


def service_config(tmp_path, **rollout):
    return make_config(
        tmp_path / "run",
        tmp_path / "model",
        rollout={"spool": str(tmp_path / "spool"), "timeout_s": 60.0, "no_worker_grace_s": 30.0, **rollout},
    )


def test_a_call_is_split_over_the_live_workers_and_gathered_in_prompt_order(tmp_path, workers):
    workers.start("echo-a")
    workers.start("echo-b")
    service = RolloutService(service_config(tmp_path))
    try:
        prompts = [f"{i}+{i}={i}{i}" for i in range(5)]
        ticket = service.submit(Ticket(tuple(prompts), WEIGHTS, 7, 0, 1))
        assert ticket.parts == (3, 2) and len(set(ticket.request_ids)) == 2  # one request per live worker
        groups = service.collect(ticket)
        assert [[s.text for s in g.samples] for g in groups] == [[p[:4]] * 4 for p in prompts]  # max_tokens 4
        assert {g.weights_step for g in groups} == {3}
        one = service.submit(Ticket(("1+1=",), WEIGHTS, 8, 0, 1))
        assert one.parts == (1,)  # never more requests than prompts
        assert [g.samples[0].text for g in service.collect(one)] == ["1+1="]
    finally:
        service.close()


def test_conversations_are_sent_as_messages_and_the_samples_gathered_in_order(tmp_path, workers):
    """The trainer sends chat rows for the worker to render; an echo worker answers each with its
    last turn, so each group is seen to come back to its own conversation."""
    workers.start("echo-a")
    service = RolloutService(service_config(tmp_path, max_tokens=16))
    try:
        chats = [
            [{"role": "system", "content": "s"}, {"role": "user", "content": f"what is {i}+{i}?"}] for i in range(3)
        ]
        ticket = service.submit(Ticket(tuple(chats), WEIGHTS, 1, 0, 1))
        groups = service.collect(ticket)
        assert [g.samples[0].text for g in groups] == [f"what is {i}+{i}?" for i in range(3)]
        (request_id,) = ticket.request_ids
        spool = Spool(tmp_path / "spool")
        archived(spool)
        request = json.loads(spool.done.joinpath(f"{request_id}.request.json").read_text())
        assert request["messages"] == chats and request["prompts"] == []
        # The same call, made again (a relaunch), names the same request.
        assert service.submit(Ticket(tuple(chats), WEIGHTS, 1, 0, 1)).request_ids == ticket.request_ids
    finally:
        service.close()


def test_a_run_directory_named_with_any_characters_gives_valid_request_and_worker_ids(tmp_path, workers):
    workers.start("echo-a")
    cfg = make_config(
        tmp_path / ",run 1+b=é",
        tmp_path / "model",
        rollout={"spool": str(tmp_path / "spool"), "timeout_s": 60.0, "no_worker_grace_s": 30.0},
    )
    service = RolloutService(cfg)
    try:
        ticket = service.submit(Ticket(("1+1=",), WEIGHTS, 0, 0, 1, tag="train set"))
        assert [id.split("-s00000000")[0] for id in ticket.request_ids] == ["x_run_1_b__-train_set"]
        assert service.worker_id == "x_run_1_b__-rollout"  # the id a spawned worker would serve under
        assert [g.samples[0].text for g in service.collect(ticket)] == ["1+1="]
    finally:
        service.close()


def test_a_relaunch_uses_results_in_the_spool_awaits_pending_ones_and_sends_only_lost_ones(tmp_path, workers):
    cfg = service_config(tmp_path, fan_out=2)
    spool = Spool(tmp_path / "spool", create=True)
    first = RolloutService(cfg)

    def call(step: int) -> Ticket:
        return first.submit(Ticket(tuple(f"{step}+{i}=" for i in range(4)), WEIGHTS, step, 0, step))

    workers.start("echo-a")
    served, consumed = call(1), call(2)
    first.collect(consumed)  # trained on by a launch that died before its next checkpoint
    deadline = time.monotonic() + 30
    while not all(spool.has_result(i) for i in served.request_ids):  # served, never collected
        assert time.monotonic() < deadline
        time.sleep(0.05)
    workers.stop("echo-a")
    pending, lost = call(3), call(4)  # no worker: both wait in requests/
    os.unlink(spool.request_path(lost.request_ids[0]))  # the spool lost half of this one
    first.close()

    second = RolloutService(cfg)  # the relaunch, from a checkpoint that recorded the four calls
    sent: list[str] = []
    submit_missing = second.client.submit_missing

    def recording(requests):
        missing = submit_missing(requests)
        sent.extend(r.request_id for r in missing)
        return missing

    second.client.submit_missing = recording
    try:
        tickets = [Ticket.from_state(t.state_dict()) for t in (served, consumed, pending, lost)]
        for ticket in tickets:
            second.restore(ticket)
        assert sent == [lost.request_ids[0]]
        # The same call made again (a step redone without a record of it) sends nothing either.
        again = second.submit(Ticket(tuple(f"1+{i}=" for i in range(4)), WEIGHTS, 1, 0, 1))
        assert again == served and sent == [lost.request_ids[0]]
        workers.start("echo-b")
        for ticket in tickets:
            assert [g.samples[0].text for g in second.collect(ticket)] == [f"{ticket.step}+{i}=" for i in range(4)]
        archived(spool)
    finally:
        second.close()
    every = [i for t in tickets for i in t.request_ids]
    done = os.listdir(spool.root / "done")
    assert sorted(n for n in done if n.endswith(".result.json")) == sorted(f"{i}.result.json" for i in every)
    assert sorted(n for n in done if n.endswith(".request.json")) == sorted(f"{i}.request.json" for i in every)
    assert os.listdir(spool.requests) == os.listdir(spool.claimed) == os.listdir(spool.results) == []


def test_a_call_not_answered_in_time_names_each_request_and_its_state(tmp_path, workers):
    worker = workers.start("echo-frozen", "--lease", "60")
    os.killpg(worker.pid, signal.SIGSTOP)  # alive by its heartbeat for a minute, serving nothing
    service = RolloutService(service_config(tmp_path, fan_out=3, timeout_s=1.0))
    try:
        ticket = service.submit(Ticket(("1+1=", "2+2=", "3+3="), WEIGHTS, 5, 1, 0))
        claimed_id, done_id, queued_id = ticket.request_ids
        spool = service.client.spool
        spool.claim(next(e for e in spool.pending() if e.request_id == claimed_id), "echo-other")
        spool.publish_results([Result(request_id=done_id, ok=True, finished_at=time.time())])
        with pytest.raises(RolloutUnavailable) as info:
            service.collect(ticket)
    finally:
        service.close()
    message = str(info.value)
    assert "step 5 (train, attempt 1)" in message and "rollout.timeout_s" in message
    assert f"{claimed_id} (claimed by echo-other)" in message
    assert f"{done_id} (done)" in message and f"{queued_id} (queued)" in message


@pytest.fixture
def servers(tmp_path):
    """Start test workers on the spool (FailingSpoolServer, echoing); all stopped at teardown."""
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


def test_an_engine_error_is_sent_again_under_a_fresh_id_and_the_call_goes_on(tmp_path, servers):
    server = servers(first(1, ErrorCode.ENGINE_ERROR))
    service = RolloutService(service_config(tmp_path, fan_out=2))
    try:
        prompts = [f"{i}+{i}={i}{i}" for i in range(4)]
        ticket = service.submit(Ticket(tuple(prompts), WEIGHTS, 2, 0, 1))
        groups = service.collect(ticket)
    finally:
        service.close()
    assert [[s.text for s in g.samples] for g in groups] == [[p[:4]] * 4 for p in prompts]
    (failed,) = server.failed
    assert failed in ticket.request_ids
    assert sorted(server.answered) == sorted([*ticket.request_ids, f"{failed}-r1"])  # the same request, a fresh id


def test_transient_errors_are_sent_again_at_most_error_retries_times_and_a_relaunch_tries_again(tmp_path, servers):
    cfg = service_config(tmp_path, error_retries=2)
    failing = servers(lambda request: ErrorCode.ENGINE_ERROR)
    first_launch = RolloutService(cfg)
    try:
        ticket = first_launch.submit(Ticket(("1+1=",), WEIGHTS, 3, 0, 1))
        with pytest.raises(RolloutUnavailable) as info:
            first_launch.collect(ticket)
    finally:
        first_launch.close()
    (request_id,) = ticket.request_ids
    assert failing.failed == [request_id, f"{request_id}-r1", f"{request_id}-r2"]
    message = str(info.value)
    assert f"{request_id}-r2" in message and "engine_error" in message and "3 times" in message
    assert "rollout.error_retries" in message and "relaunch" in message
    failing.stop()

    healthy = servers(lambda request: None, worker_id="healthy")
    relaunch = RolloutService(cfg)  # from a checkpoint that recorded the call
    try:
        restored = Ticket.from_state(ticket.state_dict())
        relaunch.restore(restored)
        assert [g.samples[0].text for g in relaunch.collect(restored)] == ["1+1="]
    finally:
        relaunch.close()
    assert healthy.answered == [f"{request_id}-r3"]  # the old errors are walked past, not sent again


@pytest.mark.parametrize("code", [ErrorCode.ENGINE_ERROR, ErrorCode.WEIGHTS_NOT_ALLOWED])
def test_a_relaunch_sends_again_what_an_earlier_launch_got_an_error_for(tmp_path, servers, code):
    cfg = service_config(tmp_path)
    failing = servers(first(1, code))
    first_launch = RolloutService(cfg)
    try:
        ticket = first_launch.submit(Ticket(("1+1=",), WEIGHTS, 3, 0, 1))
        deadline = time.monotonic() + 30
        while not failing.failed:  # the earlier launch's request failed; that launch then exited
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        first_launch.close()
    failing.stop()

    # The cause is gone now (the engine restarted; the worker's --allowed-root fixed).
    healthy = servers(lambda request: None, worker_id="healthy")
    relaunch = RolloutService(cfg)
    try:
        again = relaunch.submit(Ticket(("1+1=",), WEIGHTS, 3, 0, 1))  # the same call, redone
        assert again == ticket
        assert [g.samples[0].text for g in relaunch.collect(again)] == ["1+1="]
    finally:
        relaunch.close()
    assert healthy.answered == [f"{ticket.request_ids[0]}-r1"]


def test_a_permanent_error_stops_the_call_naming_the_request_the_error_and_what_to_do(tmp_path, servers):
    failing = servers(lambda request: ErrorCode.WEIGHTS_NOT_ALLOWED)
    service = RolloutService(service_config(tmp_path))
    try:
        ticket = service.submit(Ticket(("1+1=",), WEIGHTS, 4, 0, 1))
        with pytest.raises(RolloutFailed) as info:
            service.collect(ticket)
    finally:
        service.close()
    assert failing.failed == list(ticket.request_ids)  # never sent again: it would fail the same way
    message = str(info.value)
    assert ticket.request_ids[0] in message and "weights_not_allowed made by the test" in message
    assert "permanent" in message and "--allowed-root" in message and "relaunch" in message


def test_a_request_too_large_for_the_worker_stops_the_call_naming_the_worker_options(tmp_path, servers):
    failing = servers(lambda request: ErrorCode.REQUEST_TOO_LARGE)
    service = RolloutService(service_config(tmp_path))
    try:
        ticket = service.submit(Ticket(("1+1=",), WEIGHTS, 4, 0, 1))
        with pytest.raises(RolloutFailed) as info:
            service.collect(ticket)
    finally:
        service.close()
    assert failing.failed == list(ticket.request_ids)  # permanent: never sent again
    message = str(info.value)
    assert "request_too_large" in message and "permanent" in message
    assert "--max-samples" in message and "--max-request-tokens" in message and "rollout-svc serve" in message


def test_a_ticket_is_built_once_and_each_send_lists_the_spool_once(tmp_path, workers, monkeypatch):
    """submit (or restore) builds a ticket's requests, and collect, a resend included, reuses them; a send
    lists requests/, claimed/, results/ and bad/ once, for the check of what the spool holds and the submit."""
    service = RolloutService(service_config(tmp_path, fan_out=3))
    built = 0
    build = service._requests

    def counting(ticket):
        nonlocal built
        built += 1
        return build(ticket)

    monkeypatch.setattr(service, "_requests", counting)
    spool = service.client.spool
    listed: list[str] = []
    listdir = os.listdir

    def listing(path):
        if Path(path).parent == spool.root:
            listed.append(Path(path).name)
        return listdir(path)

    try:
        monkeypatch.setattr(os, "listdir", listing)
        ticket = service.submit(Ticket(("1+1=", "2+2=", "3+3="), WEIGHTS, 5, 0, 0))
        monkeypatch.setattr(os, "listdir", listdir)
        assert sorted(listed) == ["bad", "claimed", "requests", "results"]
        workers.start("echo-a")
        assert [g.samples[0].text for g in service.collect(ticket)] == ["1+1=", "2+2=", "3+3="]
        assert built == 1
        again = RolloutService(service_config(tmp_path, fan_out=3))  # a relaunch taking the call over
        monkeypatch.setattr(again, "_requests", counting)
        again.restore(Ticket.from_state(ticket.state_dict()))
        assert [g.samples[0].text for g in again.collect(ticket)] == ["1+1=", "2+2=", "3+3="]
        assert built == 2
        again.close()
    finally:
        service.close()
