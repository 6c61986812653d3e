"""A Prometheus textfile for node_exporter's textfile collector, rewritten atomically.

Point node_exporter's `--collector.textfile.directory` at the directory given to
`rollout-svc serve --metrics-dir`; each worker writes `rollout_svc_<worker_id>.prom`.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, write_to_textfile


class Metrics:
    def __init__(self, directory: Path, worker_id: str):
        self.path = Path(directory) / f"rollout_svc_{worker_id}.prom"
        self.registry = CollectorRegistry()
        labels = {"worker": worker_id}
        r = self.registry
        self.queue_depth = Gauge("rollout_queue_depth", "Requests waiting in requests/", ["worker"], registry=r).labels(**labels)
        self.tokens_per_s = Gauge("rollout_tokens_per_second", "Generated tokens per second in the last engine call", ["worker"], registry=r).labels(**labels)
        self.reload_s = Gauge("rollout_reload_seconds", "Duration of the last weight reload or engine build", ["worker"], registry=r).labels(**labels)
        self.tokens = Counter("rollout_generated_tokens", "Generated tokens", ["worker"], registry=r).labels(**labels)
        self.requests = Counter("rollout_requests", "Requests answered, by outcome", ["worker", "outcome"], registry=r)
        self.errors = Counter("rollout_errors", "Error results, by code", ["worker", "code"], registry=r)
        self.reloads = Counter("rollout_reloads", "Weight changes", ["worker"], registry=r).labels(**labels)
        self._worker = worker_id

    def answered(self, ok: bool, error_code: str | None = None) -> None:
        self.requests.labels(worker=self._worker, outcome="ok" if ok else "error").inc()
        if not ok and error_code:
            self.errors.labels(worker=self._worker, code=error_code).inc()

    def write(self) -> None:
        # write_to_textfile writes a temporary file and renames it: scrapers never see half.
        write_to_textfile(str(self.path), self.registry)
