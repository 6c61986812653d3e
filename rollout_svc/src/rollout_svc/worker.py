"""The serve loop: scan, pick, claim, validate, generate, publish, archive; heartbeat throughout.

    scan requests/ -> claim a batch -> load + validate each -> group by weights and sampling
    -> engine.generate per group -> check heartbeat and claims -> publish results -> done/

Exit paths: SIGTERM or SIGINT finish the batch in hand and exit 0; `idle_exit_s` without a
request exits 0; a failed heartbeat exits 1 without publishing (another worker will serve the
claims once the lease runs out).
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass

from protocol.messages import ErrorCode, MessageError, Request, Result, Timings
from protocol.spool import Claim, Spool, split_claimed_name
from protocol.watch import Waker

from .engines import Completion, Engine, RequestFailed
from .status import Heartbeat

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_HEARTBEAT_LOST = 1


@dataclass
class WorkerConfig:
    worker_id: str
    lease_s: float = 30.0  # others recover our claims when our heartbeat is older than this
    heartbeat_s: float = 2.0
    idle_exit_s: float | None = 7200.0  # None: serve forever
    rescan_s: float = 1.0  # directory scan even without file events
    max_batch: int = 64  # requests claimed per loop turn
    poll: bool | None = None  # None: poll only on filesystems without inotify


@dataclass
class _Job:
    claim: Claim
    request: Request
    claimed_at: float

    @property
    def queued_s(self) -> float:
        """From the request file's write to our claim."""
        return max(0.0, self.claimed_at - self.claim.arrived_at)


def sampling_key(request: Request) -> tuple:
    """Requests with equal keys can be served by one engine call."""
    return (
        request.weights_dir,
        request.n_samples_per_prompt,
        request.max_tokens,
        request.temperature,
        request.top_p,
        tuple(request.stop),
        request.logprobs,
        request.seed,
    )


class Worker:
    def __init__(self, spool: Spool, engine: Engine, config: WorkerConfig):
        self.spool = spool
        self.engine = engine
        self.config = config
        self.heartbeat = Heartbeat(
            spool,
            worker_id=config.worker_id,
            engine=engine.name,
            device=engine.device,
            lease_s=config.lease_s,
            interval_s=config.heartbeat_s,
        )
        self._stopping = False
        self._waker: Waker | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def request_stop(self, *_signal_args) -> None:
        """Finish the batch in hand, then exit. Safe to call from a signal handler."""
        self._stopping = True
        if self._waker is not None:
            self._waker.poke()

    def serve(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.request_stop)
        # Claims under our id are from an earlier life of this worker (same id, e.g. after a
        # crash and a systemd restart): nobody is serving them, so give them back now.
        self._recover_own_claims()
        self.heartbeat.start()
        try:
            with Waker([self.spool.requests], poll=self.config.poll) as self._waker:
                return self._loop()
        finally:
            self.heartbeat.set_state("stopping")
            self.heartbeat.stop(remove=True)
            self.engine.close()

    def _loop(self) -> int:
        cfg = self.config
        self.heartbeat.set_state("idle")
        last_work = time.monotonic()
        next_recovery = 0.0
        while not self._stopping:
            if not self.heartbeat.alive():
                log.error("heartbeat lost; exiting without publishing so others can take over")
                return EXIT_HEARTBEAT_LOST
            now = time.monotonic()
            if now >= next_recovery:
                next_recovery = now + cfg.lease_s / 4
                recovered = self.spool.recover_stale(cfg.lease_s)
                if recovered:
                    log.warning("gave back %d claims of dead workers: %s", len(recovered), recovered[:5])
            entries = self.spool.pending()
            if entries:
                served = self._serve_batch(entries[: cfg.max_batch])
                if served is not None:
                    return served
                last_work = time.monotonic()
                continue
            if cfg.idle_exit_s is not None and now - last_work >= cfg.idle_exit_s:
                log.info("idle for %.0f s; exiting to free the device", now - last_work)
                return EXIT_OK
            self._waker.wait(cfg.rescan_s)
        log.info("stop requested; exiting")
        return EXIT_OK

    def _recover_own_claims(self) -> None:
        for entry in self.spool.entries("claimed"):
            original, worker_id = split_claimed_name(entry.name)
            if worker_id == self.config.worker_id:
                self.spool.release(Claim(original, entry.path, worker_id, entry.mtime))

    # -- one batch -------------------------------------------------------------------------------

    def _serve_batch(self, entries) -> int | None:
        jobs: list[_Job] = []
        for entry in entries:
            claim = self.spool.claim(entry, self.config.worker_id)
            if claim is None:
                continue  # another worker was faster
            job = self._accept(claim)
            if job is not None:
                jobs.append(job)
        groups: dict[tuple, list[_Job]] = {}
        for job in jobs:
            groups.setdefault(sampling_key(job.request), []).append(job)
        for group in groups.values():
            results = self._generate(group)
            if not self.heartbeat.alive():
                self._abandon(group, "heartbeat lost before publishing")
                return EXIT_HEARTBEAT_LOST
            self._publish(group, results)
        self.heartbeat.set_state("idle")
        return None

    def _accept(self, claim: Claim) -> _Job | None:
        """Validate a fresh claim. Bad input is answered and archived here; None means done."""
        claimed_at = time.time()
        try:
            request = self.spool.load(claim)
        except MessageError as exc:
            log.warning("rejected %s: %s", claim.name, exc.message)
            self.spool.reject(claim, exc, self.config.worker_id)
            self.heartbeat.count(requests_failed=1)
            self.heartbeat.update(last_error=f"{claim.name}: {exc.message}")
            return None
        if self.spool.has_result(request.request_id):
            # Served before: a duplicate delivery after a lease recovery. First result stands.
            self.spool.finish(claim)
            return None
        if request.deadline is not None and claimed_at > request.deadline:
            late = claimed_at - request.deadline
            job = _Job(claim, request, claimed_at)
            message = (f"deadline passed {late:.1f} s before a worker could start it; "
                       "resubmit with a later deadline or add workers")
            self._publish([job], [self._failure(job, ErrorCode.DEADLINE_EXPIRED, message)])
            return None
        return _Job(claim, request, claimed_at)

    def _generate(self, group: list[_Job]) -> list[Result]:
        """Serve a group in one engine call. If the call fails, serve each request alone, so
        that one bad request does not fail the others."""
        self.heartbeat.set_state("generating", group[0].request.request_id)
        started = time.monotonic()
        try:
            completions = self.engine.generate([job.request for job in group])
        except Exception as exc:
            if len(group) == 1:
                return [self._error_result(group[0], exc)]
            return [r for job in group for r in self._generate([job])]
        generate_s = time.monotonic() - started
        return [self._success(job, c, generate_s) for job, c in zip(group, completions, strict=True)]

    def _publish(self, group: list[_Job], results: list[Result]) -> None:
        held = [(job, result) for job, result in zip(group, results) if self.spool.holds(job.claim)]
        lost = len(group) - len(held)
        if lost:
            # Recovered while we worked: the request is back in requests/ and someone else
            # owns it now. Publishing could still be right (first result wins), but the rule
            # is simple and safe: a worker publishes only for claims it still holds.
            log.warning("%d claims were taken back during generation; not publishing them", lost)
            self.heartbeat.count(requests_abandoned=lost)
        self.spool.publish_results([r for _, r in held])
        for job, result in held:
            self.spool.finish(job.claim)
            if result.ok:
                samples = sum(len(s) for s in result.texts)
                tokens = sum(len(t) for per_prompt in result.token_ids for t in per_prompt)
                self.heartbeat.count(requests_ok=1, samples=samples, tokens=tokens)
            else:
                self.heartbeat.count(requests_failed=1)

    def _abandon(self, group: list[_Job], why: str) -> None:
        log.error("abandoning %d requests: %s", len(group), why)
        self.heartbeat.count(requests_abandoned=len(group))

    # -- results ---------------------------------------------------------------------------------

    def _common(self, job: _Job) -> dict:
        return dict(
            request_id=job.request.request_id,
            weights_dir=self.engine.weights_dir or job.request.weights_dir,
            weights_content_id=self.engine.weights_content_id or "",
            worker_id=self.config.worker_id,
            engine=self.engine.name,
            finished_at=time.time(),
        )

    def _success(self, job: _Job, c: Completion, generate_s: float) -> Result:
        return Result(
            ok=True,
            texts=c.texts,
            token_ids=c.token_ids,
            logprobs=c.logprobs if job.request.logprobs else [],
            finish_reasons=c.finish_reasons,
            prompt_token_ids=c.prompt_token_ids,
            timings=Timings(queued_s=job.queued_s, reload_s=c.reload_s, generate_s=generate_s),
            **self._common(job),
        )

    def _failure(self, job: _Job, code: ErrorCode, message: str) -> Result:
        self.heartbeat.update(last_error=f"{job.request.request_id}: {message}")
        return Result.failure(code=code, message=message, timings=Timings(queued_s=job.queued_s), **self._common(job))

    def _error_result(self, job: _Job, exc: Exception) -> Result:
        if isinstance(exc, RequestFailed):
            return self._failure(job, exc.code, exc.message)
        log.exception("engine failed on %s", job.request.request_id)
        return self._failure(job, ErrorCode.ENGINE_ERROR, f"{type(exc).__name__}: {exc}")
