"""A Prometheus textfile for node_exporter's textfile collector, rewritten atomically.

Point node_exporter's `--collector.textfile.directory` at the directory given to
`rollout-svc serve --metrics-dir`; each worker writes `rollout_svc_<worker_id>.prom`.

The textfile counts nothing itself: each write renders the worker's own counts (the status
file's counters and the worker's Tally), so the textfile and `workers/<id>.json` always agree.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from protocol.messages import WorkerCounters

from .status import Tally


class Metrics:
    def __init__(self, directory: Path, worker_id: str):
        self.path = Path(directory) / f"rollout_svc_{worker_id}.prom"
        self.worker_id = worker_id

    def write(self, counters: WorkerCounters, tally: Tally) -> None:
        """Render the worker's counts into the textfile."""
        registry = CollectorRegistry()
        registry.register(_Snapshot(self.worker_id, counters, tally))
        # write_to_textfile writes a temporary file and renames it: scrapers never see half.
        write_to_textfile(str(self.path), registry)


class _Snapshot:
    """A prometheus_client collector yielding the families of one worker's counts."""

    def __init__(self, worker_id: str, counters: WorkerCounters, tally: Tally):
        self.worker_id, self.counters, self.tally = worker_id, counters, tally

    def collect(self):
        w, c, t = [self.worker_id], self.counters, self.tally

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["worker"])
            family.add_metric(w, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["worker"])
            family.add_metric(w, value)
            return family

        yield gauge("rollout_queue_depth", "Requests waiting in requests/", t.queue_depth)
        yield gauge(
            "rollout_tokens_per_second",
            "Generated tokens per second of generation in the last engine call (its weight load excluded)",
            t.tokens_per_s,
        )
        yield gauge("rollout_reload_seconds", "Duration of the last weight reload or engine build", t.reload_s)
        yield counter("rollout_generated_tokens", "Generated tokens", c.tokens)
        yield counter("rollout_engine_calls", "Engine calls (requests batched into one count once)", c.engine_calls)
        # Over any window: rate(generated_tokens) / rate(generation_seconds) is the generation's
        # tokens/s, and rate(reloading_seconds) the share of time spent loading weights.
        yield counter(
            "rollout_generation_seconds",
            "Seconds the engine spent generating (weight loads excluded)",
            t.generation_seconds,
        )
        yield counter(
            "rollout_reloading_seconds", "Seconds spent in weight reloads and engine builds", t.reloading_seconds
        )
        requests = CounterMetricFamily(
            "rollout_requests", "Requests answered, by outcome", labels=["worker", "outcome"]
        )
        for outcome, count in (("ok", c.requests_ok), ("error", c.requests_failed)):
            if count:  # an outcome appears once it happened, as a labelled prometheus_client Counter does
                requests.add_metric([*w, outcome], count)
        yield requests
        errors = CounterMetricFamily("rollout_errors", "Error results, by code", labels=["worker", "code"])
        for code, count in sorted(t.errors.items()):
            errors.add_metric([*w, code], count)
        yield errors
        yield counter("rollout_reloads", "Weight changes", t.reloads)
        yield gauge("rollout_asleep", "1 while the engine sleeps with its device memory given back", int(t.asleep))
        yield counter("rollout_sleeps", "Times the engine was put to sleep", t.sleeps)
        yield gauge("rollout_sleep_seconds", "Duration of the last fall asleep", t.sleep_s)
        yield counter("rollout_wakes", "Times a request woke the engine", t.wakes)
        yield gauge("rollout_wake_seconds", "Duration of the last wake, weights reloaded included", t.wake_s)
