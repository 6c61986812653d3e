"""The worker loop with the echo engine and test doubles of it: serving, batching, weight loads
in the timings, engine states in the status file, failures, deadlines, duplicates, exits,
heartbeat loss and claims taken back."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from protocol.messages import ErrorCode, Request, Result, WorkerStatus, decode_status, encode
from protocol.spool import Spool
from rollout_svc.engines.echo import EchoEngine
from rollout_svc.errors import RequestFailed
from rollout_svc.scheduling import Limits

pytestmark = pytest.mark.timeout(60)


class RecordingEngine(EchoEngine):
    """The echo engine, remembering the request ids of each call."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.closed = False

    def generate(self, requests: list[Request]):
        self.calls.append([r.request_id for r in requests])
        return super().generate(requests)

    def close(self) -> None:
        self.closed = True


class FailingEngine(RecordingEngine):
    """Fails every call that holds a prompt it cannot serve."""

    def __init__(self, exception_for):
        super().__init__()
        self.exception_for = exception_for  # prompt -> exception to raise

    def generate(self, requests):
        self.calls.append([r.request_id for r in requests])
        for request in requests:
            for prompt in request.prompts:
                if prompt in self.exception_for:
                    raise self.exception_for[prompt]
        return EchoEngine.generate(self, requests)


class HookEngine(RecordingEngine):
    """Runs `hook(requests)` inside the engine call, the first `times` calls."""

    def __init__(self, hook, times: int = 1):
        super().__init__()
        self.hook, self.times = hook, times

    def generate(self, requests):
        if len(self.calls) < self.times:
            self.hook(requests)
        return super().generate(requests)


class LoadingEngine(RecordingEngine):
    """The echo engine with weights: a call for weights it does not hold first loads them
    (`sizes[weights_dir]` bytes, a few real milliseconds) and reports the state "reloading"."""

    def __init__(self, spool: Spool, sizes: dict[str, int]):
        super().__init__()
        self.spool, self.sizes = spool, sizes
        self.weights_dir = None
        self.loads: list[tuple[str, float, int]] = []  # (weights_dir, seconds, bytes) of each load
        self.states_seen: list[str] = []  # the status file's state right after each report

    def generate(self, requests):
        weights_dir, seconds, size = requests[0].weights_dir, 0.0, 0
        if weights_dir != self.weights_dir:
            started = time.monotonic()
            self.state_listener("reloading")
            self.states_seen.append(decode_status((self.spool.workers / "w1.json").read_bytes()).state)
            time.sleep(0.02)
            seconds, size = time.monotonic() - started, self.sizes[weights_dir]
            self.weights_dir = weights_dir
            self.loads.append((weights_dir, seconds, size))
        completions = super().generate(requests)
        for completion in completions:
            completion.reload_s, completion.reload_bytes = seconds, size
        return completions


class SleepyEngine(RecordingEngine):
    """The echo engine with a sleep: it counts its sleeps, and a call made while it sleeps wakes it
    first (reporting "reloading" and taking `WAKE_S`) and records that it was asleep."""

    WAKE_S = 0.05

    def __init__(self, sleep_fails: Exception | None = None):
        super().__init__()
        self.sleep_fails = sleep_fails
        self.sleeps = 0
        self.asleep_at_call: list[bool] = []

    def sleep(self) -> float:
        if self.sleep_fails is not None:
            raise self.sleep_fails
        self.sleeps += 1
        self.asleep = True
        return 0.01

    def generate(self, requests):
        self.asleep_at_call.append(self.asleep)
        if self.asleep:
            self.state_listener("reloading")
            self.asleep, self.last_wake_s = False, self.WAKE_S
        return super().generate(requests)


def submit_aged(spool: Spool, requests: list[Request]) -> None:
    """Submit in order, each visibly older than the next, so the scan order is the list order."""
    spool.submit_many(requests)
    now = time.time()
    for i, request in enumerate(requests):
        t = now - 100 + i
        os.utime(spool.requests / f"{request.request_id}.json", (t, t))


def wait_results(spool, wait_for, ids, timeout=15.0):
    wait_for(lambda: all(spool.has_result(i) for i in ids), timeout=timeout, what=f"results of {ids}")
    return {i: spool.read_result(i) for i in ids}


# -- serving -------------------------------------------------------------------------------------------


def test_serves_a_request_and_archives_it(spool, make_request, run_worker, wait_for):
    request = make_request("r1", prompts=["hello", "hi"], n_samples_per_prompt=3, max_tokens=4)
    spool.submit(request)
    handle = run_worker(spool)
    result = wait_results(spool, wait_for, ["r1"])["r1"]
    assert result.ok and result.error is None
    assert result.texts == [["hell"] * 3, ["hi"] * 3]
    assert result.token_ids == [[[ord(c) for c in "hell"]] * 3, [[ord(c) for c in "hi"]] * 3]
    assert result.finish_reasons == [["length"] * 3, ["stop"] * 3]
    assert result.logprobs == [[[0.0] * 4] * 3, [[0.0] * 2] * 3]
    assert result.prompt_token_ids == [[ord(c) for c in "hello"], [ord(c) for c in "hi"]]
    assert result.weights_dir == request.weights_dir
    assert result.worker_id == "w1" and result.engine.startswith("echo")
    assert result.timings.queued_s >= 0 and result.finished_at > 0
    assert (result.timings.reload_s, result.timings.reload_bytes) == (0.0, 0)  # the echo loads nothing
    wait_for(lambda: (spool.done / "r1.request.json").exists(), what="the request in done/")
    assert os.listdir(spool.requests) == [] and os.listdir(spool.claimed) == []
    # One count() sets the three counters one after the other: wait for all of them.
    n = handle.counters
    wait_for(lambda: (n.requests_ok, n.samples, n.tokens) == (1, 6, 3 * 4 + 3 * 2), what="ok, samples and tokens")
    assert handle.stop() == 0


def test_logprobs_false_returns_no_logprobs(spool, make_request, run_worker, wait_for):
    spool.submit(make_request("r1", logprobs=False))
    run_worker(spool)
    result = wait_results(spool, wait_for, ["r1"])["r1"]
    assert result.ok and result.logprobs == [] and result.token_ids


def test_status_file_tells_operators_the_worker_is_alive(spool, run_worker, wait_for):
    handle = run_worker(spool, lease_s=3.0)
    path = spool.workers / "w1.json"
    wait_for(lambda: path.exists() and decode_status(path.read_bytes()).state == "idle", what="an idle status")
    status = decode_status(path.read_bytes())
    assert (status.worker_id, status.pid, status.lease_s, status.device) == ("w1", os.getpid(), 3.0, "cpu")
    assert [s.worker_id for s in spool.live_workers()] == ["w1"]
    assert handle.stop() == 0
    assert not path.exists()
    assert spool.live_workers() == []


def test_stop_closes_the_engine(spool, run_worker):
    engine = RecordingEngine()
    handle = run_worker(spool, engine)
    time.sleep(0.2)
    assert handle.stop() == 0 and engine.closed


# -- batching ------------------------------------------------------------------------------------------


def test_requests_for_the_same_weights_share_one_engine_call(spool, make_request, run_worker, wait_for):
    requests = [
        make_request("a1", prompts=["abcdef"], max_tokens=2, temperature=0.0),
        make_request("a2", prompts=["abcdef"], max_tokens=5, temperature=1.0, seed=7),
        make_request("a3", prompts=["xyz", "uvw"], max_tokens=3, top_p=0.5, n_samples_per_prompt=1),
    ]
    submit_aged(spool, requests)
    engine = RecordingEngine()
    run_worker(spool, engine)
    results = wait_results(spool, wait_for, ["a1", "a2", "a3"])
    assert engine.calls == [["a1", "a2", "a3"]]
    # One call, yet each request keeps its own sampling settings.
    assert results["a1"].texts == [["ab", "ab"]]
    assert results["a2"].texts == [["abcde", "abcde"]]
    assert results["a3"].texts == [["xyz"], ["uvw"]]


def test_different_weights_are_served_in_separate_calls(spool, make_request, run_worker, wait_for):
    requests = [
        make_request("m1", weights_dir="/models/one"),
        make_request("m2", weights_dir="/models/two"),
        make_request("m3", weights_dir="/models/one"),
        make_request("m4", weights_dir="/models/one", weights_content_id="sha-1"),
        make_request("m5", weights_dir="/models/two"),
    ]
    submit_aged(spool, requests)
    engine = RecordingEngine()
    run_worker(spool, engine)
    results = wait_results(spool, wait_for, [r.request_id for r in requests])
    assert all(r.ok for r in results.values())
    assert sorted(engine.calls) == [["m1", "m3"], ["m2", "m5"], ["m4"]]
    assert engine.calls[0] == ["m1", "m3"]  # the oldest request's weights go first


def test_batch_limits_split_engine_calls(spool, make_request, run_worker, wait_for):
    submit_aged(spool, [make_request(f"r{i}") for i in range(5)])
    engine = RecordingEngine()
    run_worker(spool, engine, limits=Limits(max_requests=2))
    wait_results(spool, wait_for, [f"r{i}" for i in range(5)])
    assert engine.calls == [["r0", "r1"], ["r2", "r3"], ["r4"]]


def test_sequence_limit_splits_engine_calls(spool, make_request, run_worker, wait_for):
    # 2 prompts x 2 samples = 4 sequences each; at most 8 per call.
    submit_aged(spool, [make_request(f"r{i}", prompts=["p", "q"], n_samples_per_prompt=2) for i in range(3)])
    engine = RecordingEngine()
    run_worker(spool, engine, limits=Limits(max_sequences=8))
    wait_results(spool, wait_for, ["r0", "r1", "r2"])
    assert engine.calls == [["r0", "r1"], ["r2"]]


# -- weight loads --------------------------------------------------------------------------------------


def test_results_report_the_seconds_and_bytes_of_each_weights_load(spool, make_request, run_worker, wait_for):
    engine = LoadingEngine(spool, {"/models/one": 1000, "/models/two": 2_000_000})
    submit_aged(spool, [make_request("a1", weights_dir="/models/one"), make_request("a2", weights_dir="/models/one")])
    run_worker(spool, engine)
    first = wait_results(spool, wait_for, ["a1", "a2"])
    spool.submit(make_request("b1", weights_dir="/models/two"))
    b1 = wait_results(spool, wait_for, ["b1"])["b1"]
    spool.submit(make_request("b2", weights_dir="/models/two"))
    b2 = wait_results(spool, wait_for, ["b2"])["b2"]
    assert engine.calls == [["a1", "a2"], ["b1"], ["b2"]]
    (_, one_s, one_bytes), (_, two_s, two_bytes) = engine.loads
    for result in first.values():  # one load for the call that served both
        assert (result.timings.reload_s, result.timings.reload_bytes) == (one_s, one_bytes) == (one_s, 1000)
    assert (b1.timings.reload_s, b1.timings.reload_bytes) == (two_s, two_bytes) == (two_s, 2_000_000)
    assert one_s >= 0.02 and two_s >= 0.02
    assert (b2.timings.reload_s, b2.timings.reload_bytes) == (0.0, 0)  # already loaded
    for result in [*first.values(), b1, b2]:
        assert result.ok and 0 <= result.timings.generate_s < 5  # the load is not counted twice


def test_engine_states_reach_the_status_file_through_the_declared_listener(spool, make_request, run_worker, wait_for):
    engine = LoadingEngine(spool, {"/models/one": 1})
    handle = run_worker(spool, engine)
    spool.submit(make_request("r1", weights_dir="/models/one"))
    wait_results(spool, wait_for, ["r1"])
    assert engine.states_seen == ["reloading"]
    wait_for(lambda: handle.worker.heartbeat.status.state == "idle", what="the idle state after the batch")


def test_a_worker_is_busy_in_its_status_file_from_its_first_claim(
    spool, make_request, run_worker, wait_for, monkeypatch
):
    """Peers read "idle" as free to serve a part of a call (the fan-out rule): from its first claim
    on, a worker's status file no longer says so."""
    from protocol.spool import Spool as SpoolClass

    states_at_claim = []
    real_claim = SpoolClass.claim

    def claim(self, entry, worker_id):
        status = next(s for _, s in self.statuses() if s is not None and s.worker_id == worker_id)
        states_at_claim.append(status.state)
        return real_claim(self, entry, worker_id)

    monkeypatch.setattr(SpoolClass, "claim", claim)
    run_worker(spool)
    wait_for(lambda: spool.live_workers(), what="the worker's first status file")
    spool.submit(make_request("r1"))
    wait_results(spool, wait_for, ["r1"])
    assert states_at_claim == ["generating"]


# -- failures ------------------------------------------------------------------------------------------


def test_a_failing_request_is_isolated_from_its_batch(spool, make_request, run_worker, wait_for):
    submit_aged(spool, [make_request("ok1", prompts=["fine"]), make_request("bad", prompts=["boom"]),
                        make_request("ok2", prompts=["also fine"])])  # fmt: skip
    engine = FailingEngine({"boom": RuntimeError("the engine choked on boom")})
    run_worker(spool, engine)
    results = wait_results(spool, wait_for, ["ok1", "bad", "ok2"])
    assert engine.calls == [["ok1", "bad", "ok2"], ["ok1"], ["bad"], ["ok2"]]
    assert results["ok1"].ok and results["ok2"].ok
    assert results["ok1"].texts == [["fine"] * 2]
    bad = results["bad"]
    assert not bad.ok and bad.error.code is ErrorCode.ENGINE_ERROR
    assert "RuntimeError" in bad.error.message and "the engine choked on boom" in bad.error.message
    assert "the log of worker w1 has the traceback" in bad.error.message
    assert bad.texts == [] and bad.worker_id == "w1"
    # A valid request the engine failed on is archived like a served one, not kept as bad input.
    wait_for(lambda: (spool.done / "bad.request.json").exists(), what="the failed request in done/")
    assert not os.path.lexists(spool.bad / "bad.json")


def test_request_failed_keeps_its_own_code(spool, make_request, run_worker, wait_for):
    submit_aged(spool, [make_request("long", prompts=["too long"]), make_request("short", prompts=["ok"])])
    engine = FailingEngine({"too long": RequestFailed(ErrorCode.PROMPT_TOO_LONG, "prompt of 9999 tokens, limit 2048")})
    handle = run_worker(spool, engine)
    results = wait_results(spool, wait_for, ["long", "short"])
    assert results["long"].error.code is ErrorCode.PROMPT_TOO_LONG
    assert results["long"].error.message == "prompt of 9999 tokens, limit 2048"
    assert results["short"].ok
    wait_for(lambda: handle.counters.requests_failed == 1 and handle.counters.requests_ok == 1, what="counters")
    assert "prompt of 9999 tokens" in handle.worker.heartbeat.status.last_error
    # Refused for its content (the contract's bad input): kept in bad/, where `spoolctl requeue` finds it.
    assert (spool.bad / "long.json").exists() and not (spool.done / "long.request.json").exists()
    assert (spool.done / "short.request.json").exists()


def test_an_expired_deadline_is_answered_without_the_engine(spool, make_request, run_worker, wait_for):
    spool.submit(make_request("late", deadline=time.time() - 30))
    spool.submit(make_request("in-time", deadline=time.time() + 600))
    engine = RecordingEngine()
    run_worker(spool, engine)
    results = wait_results(spool, wait_for, ["late", "in-time"])
    late = results["late"]
    assert not late.ok and late.error.code is ErrorCode.DEADLINE_EXPIRED
    assert "deadline passed" in late.error.message and "later deadline" in late.error.message
    assert results["in-time"].ok
    assert engine.calls == [["in-time"]]
    wait_for(lambda: (spool.done / "late.request.json").exists(), what="the late request in done/")


def test_a_duplicate_delivery_is_archived_without_running(spool, make_request, run_worker, wait_for):
    """A request whose result exists (served before a lease recovery) keeps its first result."""
    spool.publish_results([Result.failure("dup", ErrorCode.ENGINE_ERROR, "first execution")])
    first = (spool.results / "dup.json").read_bytes()
    (spool.requests / "dup.json").write_bytes(encode(make_request("dup")))
    engine = RecordingEngine()
    run_worker(spool, engine)
    wait_for(lambda: (spool.done / "dup.request.json").exists(), what="the duplicate in done/")
    assert engine.calls == []
    assert (spool.results / "dup.json").read_bytes() == first
    assert os.listdir(spool.claimed) == [] and os.listdir(spool.requests) == []


# -- exits ---------------------------------------------------------------------------------------------


def test_idle_exit(spool, run_worker):
    started = time.monotonic()
    handle = run_worker(spool, idle_exit_s=0.5)
    assert handle.join(10) == 0
    assert 0.5 <= time.monotonic() - started < 5
    assert os.listdir(spool.workers) == []


def test_idle_time_counts_from_the_last_request(spool, make_request, run_worker, wait_for):
    handle = run_worker(spool, idle_exit_s=1.0)
    time.sleep(0.6)
    spool.submit(make_request("keeps-it-busy"))
    wait_results(spool, wait_for, ["keeps-it-busy"])
    served = time.monotonic()
    assert handle.join(10) == 0
    assert time.monotonic() - served >= 0.8


def test_a_stop_just_before_the_engine_call_still_gives_the_batch_its_grace(spool, make_request, run_worker, caplog):
    """The signal lands once the status says "generating" but before the engine call: the batch
    gets the stop grace all the same (the alarm, and the line that tells the operator), is
    served, and the worker exits 0."""
    import rollout_svc.worker as worker_module

    handle = run_worker(spool, stop_grace_s=7)
    heartbeat = handle.worker.heartbeat
    set_state = heartbeat.set_state

    def stop_once_generating(state, current_request=None):
        set_state(state, current_request)
        if state == "generating":
            handle.worker.request_stop()

    heartbeat.set_state = stop_once_generating
    spool.submit(make_request("last"))
    assert handle.join(10) == 0
    assert spool.read_result("last").ok
    assert worker_module.signal.alarms == [7, 0]  # the grace, then cleared after the call
    assert "the batch in hand has 7 s (--stop-grace) to finish" in caplog.text


# -- sleep when idle ------------------------------------------------------------------------------------


def status_of(spool: Spool) -> WorkerStatus:
    return decode_status((spool.workers / "w1.json").read_bytes())


def test_an_idle_worker_puts_its_engine_to_sleep_and_a_request_wakes_it(spool, make_request, run_worker, wait_for):
    engine = SleepyEngine()
    handle = run_worker(spool, engine, sleep_when_idle_s=0.3)
    # The tally changes before the status file is rewritten: wait for what an operator sees.
    wait_for(lambda: handle.worker.tally.asleep and status_of(spool).state == "sleeping", what="the engine asleep")
    assert engine.sleeps == 1 and engine.asleep
    tally = handle.worker.tally
    assert (tally.sleeps, tally.sleep_s, tally.wakes) == (1, 0.01, 0)
    spool.submit(make_request("wakes-it"))
    assert wait_results(spool, wait_for, ["wakes-it"])["wakes-it"].ok
    assert engine.asleep_at_call == [True] and not engine.asleep
    wait_for(lambda: tally.wakes == 1 and not tally.asleep, what="the wake counted")  # asleep is set last
    assert tally.wake_s == SleepyEngine.WAKE_S
    # Idle again, it sleeps again: the idle time counts from the last request.
    wait_for(lambda: tally.sleeps == 2, what="a second sleep")  # counted after the engine's sleep() returns
    assert engine.sleeps == 2 and handle.stop() == 0


def test_no_sleep_without_the_setting(spool, run_worker):
    engine = SleepyEngine()
    handle = run_worker(spool, engine)
    time.sleep(0.5)
    assert engine.sleeps == 0 and not engine.asleep
    assert handle.stop() == 0


def test_an_engine_that_cannot_sleep_is_closed_and_the_worker_serves_on(spool, make_request, run_worker, wait_for):
    engine = SleepyEngine(sleep_fails=RuntimeError("no sleep mode in this engine"))
    handle = run_worker(spool, engine, sleep_when_idle_s=0.1)
    wait_for(lambda: engine.closed, what="the engine closed")
    assert status_of(spool).state == "idle" and handle.worker.tally.sleeps == 0
    spool.submit(make_request("after"))
    assert wait_results(spool, wait_for, ["after"])["after"].ok
    assert handle.stop() == 0


def _rollout_svc() -> str:
    return str(Path(sys.executable).parent / "rollout-svc")


def test_sigterm_stops_a_serving_process_cleanly(spool, make_request, wait_for):
    spool.submit(make_request("before-term"))
    process = subprocess.Popen(
        [_rollout_svc(), "serve", "--spool", str(spool.root), "--engine", "echo", "--worker-id", "sub1",
         "--idle-exit", "0", "--lease", "3", "--heartbeat", "0.5", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_results(spool, wait_for, ["before-term"], timeout=30)
        wait_for(lambda: (spool.workers / "sub1.json").exists(), what="the status file")
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, output.decode(errors="replace")
    assert spool.read_result("before-term").worker_id == "sub1"
    assert not (spool.workers / "sub1.json").exists()
    assert os.listdir(spool.claimed) == []
    assert os.listdir(spool.requests) == []


# -- heartbeat and claims (guarantee 4) ----------------------------------------------------------------


def test_heartbeat_loss_abandons_the_batch_and_exits_1(spool, make_request, run_worker, wait_for, monkeypatch):
    broken = threading.Event()
    real_write_status = spool.write_status

    def write_status(status):
        if broken.is_set():
            raise PermissionError(errno.EACCES, "Permission denied")
        real_write_status(status)

    monkeypatch.setattr(spool, "write_status", write_status)
    handles = []

    def lose_heartbeat(_requests):
        broken.set()  # the status file can no longer be written...
        wait_for(lambda: not handles[0].worker.heartbeat.alive(), timeout=10, what="the heartbeat to lapse")

    engine = HookEngine(lose_heartbeat)
    handles.append(run_worker(spool, engine, lease_s=1.0, heartbeat_s=0.2))
    spool.submit(make_request("hb"))
    assert handles[0].join(15) == 1
    assert engine.calls == [["hb"]]
    assert os.listdir(spool.results) == []  # ...so nothing is published
    assert os.listdir(spool.claimed) == ["hb@w1.json"]  # left for the lease to give back
    assert handles[0].counters.requests_abandoned == 1 and handles[0].counters.requests_ok == 0
    assert spool.recover_stale(default_lease_s=1.0, now=time.time() + 5) == ["hb.json"]


def test_heartbeat_loss_while_idle_exits_1(spool, run_worker, monkeypatch):
    handle = run_worker(spool, lease_s=1.0, heartbeat_s=0.2)
    time.sleep(0.3)

    def write_status(status):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(spool, "write_status", write_status)
    assert handle.join(10) == 1


def test_own_claims_of_an_earlier_life_are_released_at_start(spool, make_request, run_worker, wait_for):
    (spool.claimed / "mine@w1.json").write_bytes(encode(make_request("mine")))
    (spool.claimed / "theirs@w2.json").write_bytes(encode(make_request("theirs")))
    now = time.time()
    spool.write_status(
        WorkerStatus(worker_id="w2", pid=1, host="h", device="cpu", engine="echo", state="generating",
                     lease_s=60.0, started_at=now, heartbeat_at=now)
    )  # fmt: skip
    engine = RecordingEngine()
    handle = run_worker(spool, engine)
    result = wait_results(spool, wait_for, ["mine"])["mine"]
    assert result.ok and result.worker_id == "w1"
    time.sleep(0.3)  # a few more loop turns: the live worker's claim must stay untouched
    assert handle.stop() == 0
    assert os.listdir(spool.claimed) == ["theirs@w2.json"]
    assert engine.calls == [["mine"]]


@pytest.mark.parametrize("taken", ["deleted", "requeued"])
def test_a_claim_taken_back_during_generation_is_not_published(spool, make_request, run_worker, wait_for, taken):
    def take_back(requests):
        claim = spool.claimed / f"{requests[0].request_id}@w1.json"
        if taken == "deleted":  # another worker served it and archived it meanwhile
            claim.unlink()
        else:  # lease recovery put it back in requests/
            os.rename(claim, spool.requests / f"{requests[0].request_id}.json")

    engine = HookEngine(take_back)
    handle = run_worker(spool, engine)
    spool.submit(make_request("tb"))
    wait_for(lambda: handle.counters.requests_abandoned == 1, what="the abandoned counter")
    if taken == "deleted":
        time.sleep(0.3)
        assert handle.stop() == 0
        assert os.listdir(spool.results) == [] and os.listdir(spool.done) == []
        assert engine.calls == [["tb"]] and handle.counters.requests_ok == 0
    else:  # served again from requests/, published once, by the second execution
        result = wait_results(spool, wait_for, ["tb"])["tb"]
        assert handle.stop() == 0
        assert result.ok and engine.calls == [["tb"], ["tb"]]
        assert handle.counters.requests_ok == 1 and handle.counters.requests_abandoned == 1


def test_a_claim_taken_back_before_it_is_read_does_not_crash_the_worker(
    spool, make_request, run_worker, wait_for, monkeypatch
):
    real_load, taken = spool.load, []

    def load(claim, *args, **kwargs):
        if not taken:  # the first claim goes back to requests/ right after the rename
            taken.append(claim.name)
            os.rename(claim.path, spool.requests / claim.name)
        return real_load(claim, *args, **kwargs)

    monkeypatch.setattr(spool, "load", load)
    spool.submit(make_request("race"))
    handle = run_worker(spool)
    wait_for(lambda: spool.has_result("race") or not handle.thread.is_alive(), what="a result or a dead worker")
    assert handle.error is None, f"worker crashed: {handle.error!r}"
    assert taken == ["race.json"]
    assert spool.read_result("race").ok  # served from its requeued copy


# -- OSErrors: a full disk stops the worker, one file's failure does not -------------------------------
# Test doubles of the failing call, for the errnos the kernel cannot be made to give here; the
# real ones (ENAMETOOLONG, EPERM, ENOSPC, EFBIG) are in tests/e2e/test_worker_one_bad_file.py
# and test_worker_full_disk.py.


@pytest.fixture
def failing(monkeypatch):
    """failing(call, errno, match, times=None): os.<call> fails with `errno` for a first path
    argument whose name starts with `match`, `times` times (None: always). Returns the list of
    failed attempts. Retries are made quick."""
    import rollout_svc.errors

    monkeypatch.setattr(rollout_svc.errors, "RETRY_DELAYS_S", (0.01, 0.02, 0.04, 0.08), raising=False)
    attempts: list[str] = []

    def make(call: str, code: int, match: str, times: int | None = None) -> list[str]:
        real = getattr(os, call)

        def double(path, *args, **kwargs):
            name = os.path.basename(os.fspath(path)) if not isinstance(path, int) else _fd_name(path)
            if name.startswith(match) and (times is None or len(attempts) < times):
                attempts.append(name)
                raise OSError(code, os.strerror(code), None if isinstance(path, int) else os.fspath(path))
            return real(path, *args, **kwargs)

        monkeypatch.setattr(os, call, double)
        return attempts

    return make


def _fd_name(fd: int) -> str:
    try:
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return ""


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_a_full_disk_or_quota_gives_the_claim_back_and_exits_74_naming_the_file(
    spool, make_request, run_worker, failing, caplog, code
):
    spool.submit(make_request("full"))
    failing("write", code, "full")  # writing the result's bytes fails; the status file still fits
    handle = run_worker(spool)
    assert handle.join(15) == 74
    assert spool.request_path("full").exists() and not spool.has_result("full")
    assert os.listdir(spool.tmp) == [] and os.listdir(spool.claimed) == [] and os.listdir(spool.results) == []
    message = next(r.getMessage() for r in caplog.records if "cannot write to the spool" in r.getMessage())
    assert os.strerror(code) in message and f"-> '{spool.result_path('full')}'" in message
    assert "gave back 1 requests" in message and "Free space" in message


@pytest.mark.parametrize("code", [errno.ESTALE, errno.EIO])
def test_a_stale_handle_or_io_error_is_tried_again(spool, make_request, run_worker, wait_for, failing, caplog, code):
    spool.submit(make_request("flaky"))
    attempts = failing("rename", code, "flaky", times=2)
    handle = run_worker(spool)
    assert wait_results(spool, wait_for, ["flaky"])["flaky"].ok
    assert handle.stop() == 0
    assert attempts == ["flaky.json", "flaky.json"]
    assert sum("trying again" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.parametrize(
    ("call", "code", "tries"),
    [
        ("rename", errno.ESTALE, 5),  # claiming: tried again, then skipped
        ("rename", errno.EIO, 5),
        ("rename", errno.EBUSY, 1),  # not a passing error: skipped at once
        ("link", errno.EIO, 5),  # publishing its result: tried again, then the claim goes back
    ],
)
def test_one_files_failure_skips_it_and_the_worker_serves_on(
    spool, make_request, run_worker, wait_for, failing, caplog, call, code, tries
):
    submit_aged(spool, [make_request("bad-1")])
    attempts = failing(call, code, "bad-")
    handle = run_worker(spool, skip_s=3600)
    wait_for(lambda: len(attempts) >= tries, what="the attempts")
    spool.submit(make_request("good"))
    assert wait_results(spool, wait_for, ["good"])["good"].ok  # served after the bad one failed
    spool.submit(make_request("good-2"))
    assert wait_results(spool, wait_for, ["good-2"])["good-2"].ok  # many scans later...
    assert len(attempts) == tries  # ...the skipped file was not tried again
    assert handle.stop() == 0
    assert spool.request_path("bad-1").exists() and not spool.has_result("bad-1")
    assert os.listdir(spool.claimed) == [] and os.listdir(spool.tmp) == []
    skipped = [r.getMessage() for r in caplog.records if "tries this one again in 3600.0 s" in r.getMessage()]
    assert len(skipped) == 1 and "requests/bad-1.json" in skipped[0] and os.strerror(code) in skipped[0]


@pytest.mark.parametrize("call", ["rename", "link"])  # claiming it fails, or publishing its result
def test_a_skipped_file_is_tried_again_later_and_served(
    spool, make_request, run_worker, wait_for, failing, caplog, call
):
    spool.submit(make_request("later"))
    attempts = failing(call, errno.EBUSY, "later", times=2)
    handle = run_worker(spool, skip_s=0.2)
    assert wait_results(spool, wait_for, ["later"])["later"].ok
    assert handle.stop() == 0
    assert len(attempts) == 2
    waits = [r.getMessage() for r in caplog.records if "tries this one again in" in r.getMessage()]
    assert len(waits) == 2 and "again in 0.2 s" in waits[0] and "again in 0.4 s" in waits[1]  # doubling


def test_a_spool_that_cannot_be_listed_exits_74(spool, run_worker, failing, caplog):
    attempts = failing("scandir", errno.EIO, "requests")
    handle = run_worker(spool)
    assert handle.join(15) == 74
    assert len(attempts) == 5
    assert any("cannot use the spool" in r.getMessage() and "Check its filesystem" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_a_full_disk_status_file_gives_the_batch_back_and_exits_74(
    spool, make_request, run_worker, wait_for, monkeypatch, caplog
):
    broken = threading.Event()
    real_write_status = spool.write_status

    def write_status(status):
        if broken.is_set():
            error = OSError(errno.ENOSPC, "No space left on device", str(spool.scratch_path("w1.json")))
            error.filename2 = str(spool.status_path("w1"))
            raise error
        real_write_status(status)

    monkeypatch.setattr(spool, "write_status", write_status)
    handles = []

    def lose_heartbeat(_requests):
        broken.set()
        wait_for(lambda: not handles[0].worker.heartbeat.alive(), timeout=10, what="the heartbeat to lapse")

    handles.append(run_worker(spool, HookEngine(lose_heartbeat), lease_s=1.0, heartbeat_s=0.2))
    spool.submit(make_request("hb"))
    assert handles[0].join(15) == 74
    assert os.listdir(spool.results) == [] and os.listdir(spool.claimed) == []
    assert spool.request_path("hb").exists()  # given back at once, not left for the lease
    message = next(r.getMessage() for r in caplog.records if "cannot write to the spool" in r.getMessage())
    assert f"-> '{spool.status_path('w1')}'" in message


def test_a_claim_whose_rename_reply_was_lost_is_still_served(spool, make_request, run_worker, wait_for, monkeypatch):
    """Over NFS a rename may move the file and still report EIO (its reply lost); the retry then
    finds the file gone. The claim under our id is ours: served, not left in claimed/."""
    import rollout_svc.errors

    monkeypatch.setattr(rollout_svc.errors, "RETRY_DELAYS_S", (0.01,), raising=False)
    spool.submit(make_request("lost-reply"))
    real_rename, lost = os.rename, []

    def rename(src, dst, *args, **kwargs):
        real_rename(src, dst, *args, **kwargs)
        if os.path.basename(src) == "lost-reply.json" and not lost:
            lost.append(dst)
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(src))

    monkeypatch.setattr(os, "rename", rename)
    handle = run_worker(spool)
    assert wait_results(spool, wait_for, ["lost-reply"])["lost-reply"].ok
    wait_for(lambda: os.listdir(spool.claimed) == [], what="the claim archived")
    assert handle.stop() == 0
    assert lost == [spool.claimed / "lost-reply@w1.json"]
