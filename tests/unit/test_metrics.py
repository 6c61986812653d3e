"""The Prometheus textfile: atomic rewrites that parse, counters by outcome and error code, and
the file a real echo worker keeps while it serves, which shows the worker's own counts."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import types
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

import rollout_svc.worker as worker_module
from protocol.messages import WorkerCounters
from protocol.spool import Spool
from rollout_svc.engines.echo import EchoEngine
from rollout_svc.metrics import Metrics
from rollout_svc.status import Tally
from rollout_svc.worker import Worker, WorkerConfig

pytestmark = pytest.mark.timeout(60)

FAMILIES = {
    "rollout_queue_depth",
    "rollout_tokens_per_second",
    "rollout_reload_seconds",
    "rollout_generated_tokens",
    "rollout_engine_calls",
    "rollout_generation_seconds",
    "rollout_reloading_seconds",
    "rollout_requests",
    "rollout_errors",
    "rollout_reloads",
    "rollout_asleep",
    "rollout_sleeps",
    "rollout_sleep_seconds",
    "rollout_wakes",
    "rollout_wake_seconds",
}


def parse(path) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a textfile; fails on a file that does not parse."""
    families = list(text_string_to_metric_families(path.read_text()))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def families(path) -> set[str]:
    """Family names, less the `_created` timestamps prometheus_client adds to counters."""
    return {f.name for f in text_string_to_metric_families(path.read_text()) if not f.name.endswith("_created")}


def value(parsed, name: str, **labels) -> float | None:
    return parsed.get((name, tuple(sorted(labels.items()))))


def test_the_file_is_named_for_node_exporter(tmp_path):
    metrics = Metrics(tmp_path, "host-gpu0")
    assert metrics.path == tmp_path / "rollout_svc_host-gpu0.prom"
    assert not metrics.path.exists()  # nothing is written before write()
    metrics.write(WorkerCounters(), Tally())
    assert os.listdir(tmp_path) == ["rollout_svc_host-gpu0.prom"]


def test_a_fresh_file_parses_with_every_family_at_zero(tmp_path):
    metrics = Metrics(tmp_path, "w1")
    metrics.write(WorkerCounters(), Tally())
    assert families(metrics.path) == FAMILIES
    parsed = parse(metrics.path)
    for name in (
        "rollout_queue_depth",
        "rollout_tokens_per_second",
        "rollout_reload_seconds",
        "rollout_generated_tokens_total",
        "rollout_engine_calls_total",
        "rollout_generation_seconds_total",
        "rollout_reloading_seconds_total",
        "rollout_reloads_total",
        "rollout_asleep",
        "rollout_sleeps_total",
        "rollout_sleep_seconds",
        "rollout_wakes_total",
        "rollout_wake_seconds",
    ):
        assert value(parsed, name, worker="w1") == 0.0, name
    assert not any(name in ("rollout_requests_total", "rollout_errors_total") for name, _ in parsed)


def test_counters_by_outcome_and_error_code(tmp_path):
    metrics = Metrics(tmp_path, "w1")
    counters = WorkerCounters(requests_ok=2, requests_failed=3, requests_abandoned=5)
    metrics.write(counters, Tally(errors=Counter(bad_json=2, weights_invalid=1)))
    parsed = parse(metrics.path)
    assert value(parsed, "rollout_requests_total", worker="w1", outcome="ok") == 2
    assert value(parsed, "rollout_requests_total", worker="w1", outcome="error") == 3
    assert value(parsed, "rollout_errors_total", worker="w1", code="bad_json") == 2
    assert value(parsed, "rollout_errors_total", worker="w1", code="weights_invalid") == 1
    codes = sorted(dict(labels)["code"] for name, labels in parsed if name == "rollout_errors_total")
    assert codes == ["bad_json", "weights_invalid"]


def test_the_file_shows_the_counts_it_is_given_and_nothing_else(tmp_path):
    metrics = Metrics(tmp_path, "w1")
    counters = WorkerCounters(tokens=42)
    tally = Tally(
        queue_depth=7, tokens_per_s=123.5, reload_s=2.25, reloads=1, generation_seconds=0.5, reloading_seconds=3.5
    )
    metrics.write(counters, tally)
    parsed = parse(metrics.path)
    assert value(parsed, "rollout_generation_seconds_total", worker="w1") == 0.5
    assert value(parsed, "rollout_reloading_seconds_total", worker="w1") == 3.5
    assert value(parsed, "rollout_queue_depth", worker="w1") == 7
    assert value(parsed, "rollout_tokens_per_second", worker="w1") == 123.5
    assert value(parsed, "rollout_reload_seconds", worker="w1") == 2.25
    assert value(parsed, "rollout_generated_tokens_total", worker="w1") == 42
    assert value(parsed, "rollout_reloads_total", worker="w1") == 1
    metrics.write(counters, tally)  # rendering again counts nothing twice
    assert parse(metrics.path) == parsed
    tally.queue_depth = 0
    metrics.write(counters, tally)
    assert value(parse(metrics.path), "rollout_queue_depth", worker="w1") == 0


def test_sleeps_and_wakes_are_shown_with_their_seconds(tmp_path):
    metrics = Metrics(tmp_path, "w1")
    metrics.write(WorkerCounters(), Tally(asleep=True, sleeps=3, sleep_s=0.75, wakes=2, wake_s=1.5))
    parsed = parse(metrics.path)
    assert value(parsed, "rollout_asleep", worker="w1") == 1
    assert value(parsed, "rollout_sleeps_total", worker="w1") == 3
    assert value(parsed, "rollout_sleep_seconds", worker="w1") == 0.75
    assert value(parsed, "rollout_wakes_total", worker="w1") == 2
    assert value(parsed, "rollout_wake_seconds", worker="w1") == 1.5
    metrics.write(WorkerCounters(), Tally(asleep=False))
    assert value(parse(metrics.path), "rollout_asleep", worker="w1") == 0


def test_two_workers_in_one_directory_keep_separate_files(tmp_path):
    a, b = Metrics(tmp_path, "a"), Metrics(tmp_path, "b")
    a.write(WorkerCounters(requests_ok=1), Tally())
    b.write(WorkerCounters(), Tally())
    assert value(parse(a.path), "rollout_requests_total", worker="a", outcome="ok") == 1
    assert not any(name == "rollout_requests_total" for name, _ in parse(b.path))


def test_each_write_replaces_the_file_whole(tmp_path):
    """Readers never see a half-written file: every rewrite is a new file renamed into place,
    and a reader polling during many rewrites always parses every family."""
    metrics = Metrics(tmp_path, "w1")
    counters, tally = WorkerCounters(requests_ok=1), Tally()
    metrics.write(counters, tally)
    first_inode = metrics.path.stat().st_ino
    metrics.write(counters, tally)
    assert metrics.path.stat().st_ino != first_inode  # renamed over, not rewritten in place

    stop = threading.Event()
    snapshots: set[str] = set()

    def read_loop():  # reads only: parsing here would starve the writer of the GIL
        while not stop.is_set():
            snapshots.add(metrics.path.read_text())

    reader = threading.Thread(target=read_loop)
    reader.start()
    try:
        for i in range(100):
            counters.requests_ok += 1
            counters.requests_failed += 1
            tally.errors[f"code_{i % 20}"] += 1  # the file grows as codes appear
            metrics.write(counters, tally)
    finally:
        stop.set()
        reader.join(10)
    assert len(snapshots) > 5
    for text in snapshots:
        found = {f.name for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}
        assert found == FAMILIES, text
        assert text.endswith("\n")
    assert os.listdir(tmp_path) == ["rollout_svc_w1.prom"]  # no scratch file left behind
    assert value(parse(metrics.path), "rollout_requests_total", worker="w1", outcome="ok") == 101


# -- a real worker -------------------------------------------------------------------------------


@pytest.fixture
def serve_with_metrics(monkeypatch):
    """Run a Worker with a Metrics object in a thread; stops it at the end of the test.

    Signal handlers belong to the main thread, so the worker module sees a stand-in."""
    import signal

    monkeypatch.setattr(
        worker_module,
        "signal",
        types.SimpleNamespace(
            SIGTERM=signal.SIGTERM,
            SIGINT=signal.SIGINT,
            SIGALRM=signal.SIGALRM,
            signal=lambda *args: None,
            alarm=lambda seconds: 0,
        ),
    )
    running = []

    def start(spool: Spool, metrics: Metrics, engine=None) -> Worker:
        config = WorkerConfig(worker_id="w1", lease_s=3.0, heartbeat_s=0.2, idle_exit_s=None, rescan_s=0.1)
        worker = Worker(spool, engine or EchoEngine(), config, metrics=metrics)
        outcome = {}
        thread = threading.Thread(target=lambda: outcome.update(rc=worker.serve()), daemon=True)
        thread.start()
        running.append((worker, thread, outcome))
        return worker

    yield start
    for worker, thread, outcome in running:
        worker.request_stop()
        thread.join(10)
        assert not thread.is_alive(), "worker did not stop"
        assert outcome.get("rc") == 0


def test_a_worker_counts_a_good_and_a_bad_request(spool, make_request, wait_for, tmp_path, serve_with_metrics):
    metrics = Metrics(tmp_path / "metrics", "w1")
    (tmp_path / "metrics").mkdir()
    serve_with_metrics(spool, metrics)
    wait_for(lambda: metrics.path.exists(), what="the metrics file")
    spool.submit(make_request("good", prompts=["hello world"], n_samples_per_prompt=2, max_tokens=5))
    (spool.tmp / "bad.json").write_bytes(b"{not json")
    os.rename(spool.tmp / "bad.json", spool.requests / "bad.json")
    wait_for(lambda: spool.has_result("good") and spool.has_result("bad"), what="both results")

    def counted():
        parsed = parse(metrics.path)
        done = (
            value(parsed, "rollout_requests_total", worker="w1", outcome="ok") == 1
            and value(parsed, "rollout_requests_total", worker="w1", outcome="error") == 1
            and value(parsed, "rollout_queue_depth", worker="w1") == 0
        )
        return parsed if done else None

    parsed = wait_for(counted, what="ok=1 and error=1 in the textfile")
    assert value(parsed, "rollout_errors_total", worker="w1", code="bad_json") == 1
    assert [dict(labels)["code"] for n, labels in parsed if n == "rollout_errors_total"] == ["bad_json"]
    assert value(parsed, "rollout_generated_tokens_total", worker="w1") == 10  # 2 samples x 5 tokens
    assert value(parsed, "rollout_engine_calls_total", worker="w1") == 1  # the bad file never reaches the engine
    assert value(parsed, "rollout_tokens_per_second", worker="w1") > 0
    assert value(parsed, "rollout_reloads_total", worker="w1") == 0  # echo never reloads
    assert spool.read_result("bad").error.code.value == "bad_json"


class ReloadingEngine(EchoEngine):
    """The echo engine, whose first call loads weights for 0.25 s of a call of at least 0.3 s."""

    def __init__(self):
        self.calls = 0

    def generate(self, requests):
        self.calls += 1
        completions = super().generate(requests)
        if self.calls == 1:
            time.sleep(0.3)
            completions = [dataclasses.replace(c, reload_s=0.25, reload_bytes=1000) for c in completions]
        return completions


def test_a_worker_shows_generation_tokens_per_second_and_reload_seconds(
    spool, make_request, wait_for, tmp_path, serve_with_metrics
):
    """The tokens/s gauge is the generation's, the weight load left out; the seconds counters add
    up every call, so that rate(tokens) / rate(generation seconds) holds over any window."""
    metrics = Metrics(tmp_path, "w1")

    def tokens(count: int):
        parsed = parse(metrics.path) if metrics.path.exists() else {}
        return parsed if value(parsed, "rollout_generated_tokens_total", worker="w1") == count else None

    serve_with_metrics(spool, metrics, ReloadingEngine())
    spool.submit(make_request("first", prompts=["hello world"], n_samples_per_prompt=2, max_tokens=5))
    first = wait_for(lambda: tokens(10), what="the first request's tokens in the textfile")
    generation_s = value(first, "rollout_generation_seconds_total", worker="w1")
    assert value(first, "rollout_reloading_seconds_total", worker="w1") == 0.25
    assert value(first, "rollout_reload_seconds", worker="w1") == 0.25
    assert value(first, "rollout_reloads_total", worker="w1") == 1
    assert 0.05 <= generation_s  # the call's time but its load
    assert value(first, "rollout_tokens_per_second", worker="w1") == pytest.approx(10 / generation_s)
    spool.submit(make_request("second", prompts=["hello"], n_samples_per_prompt=1, max_tokens=3))
    second = wait_for(lambda: tokens(13), what="the second request's tokens in the textfile")
    assert value(second, "rollout_reloading_seconds_total", worker="w1") == 0.25  # no load this time
    assert value(second, "rollout_generation_seconds_total", worker="w1") > generation_s


class ServedElsewhereEngine(EchoEngine):
    """The echo engine; while serving its first call, another worker finishes that request."""

    def __init__(self, spool: Spool):
        self.spool, self.calls = spool, 0

    def generate(self, requests):
        self.calls += 1
        if self.calls == 1:
            (self.spool.claimed / f"{requests[0].request_id}@w1.json").unlink()
        return super().generate(requests)


def test_the_textfile_shows_the_counts_of_the_status_file(spool, make_request, wait_for, tmp_path, serve_with_metrics):
    """One source of counts: tokens generated for a request whose claim was lost are counted
    nowhere, and the textfile's figures are the status file's."""
    metrics = Metrics(tmp_path, "w1")
    worker = serve_with_metrics(spool, metrics, ServedElsewhereEngine(spool))
    spool.submit(make_request("lost", prompts=["abcdefgh"], n_samples_per_prompt=3, max_tokens=8))
    counters = worker.heartbeat.status.counters
    wait_for(lambda: counters.requests_abandoned == 1, what="the lost claim")
    spool.submit(make_request("kept", prompts=["hello"], n_samples_per_prompt=2, max_tokens=4))
    wait_for(lambda: spool.has_result("kept"), what="the result")

    def rendered():
        parsed = parse(metrics.path)
        return parsed if value(parsed, "rollout_requests_total", worker="w1", outcome="ok") == 1 else None

    parsed = wait_for(rendered, what="ok=1 in the textfile")
    assert counters.tokens == 2 * 4 and counters.requests_ok == 1
    assert value(parsed, "rollout_generated_tokens_total", worker="w1") == counters.tokens
    assert value(parsed, "rollout_requests_total", worker="w1", outcome="error") is None
