"""The serve loop: scan, pick, claim, validate, generate, publish, archive; heartbeat throughout.

    scan requests/ -> scheduler picks a batch -> claim + validate each -> one engine call per
    weights -> check heartbeat and claims -> publish results -> archive in done/

With `sleep_when_idle_s`, a worker that has had no request for that long puts its engine to
sleep (its device memory given back; another process may use the device meanwhile) and says so
in its status file (state "sleeping", and `rollout_asleep` in the metrics textfile); the next
request wakes the engine before it is served.

Exit paths (protocol.exit_codes): SIGTERM or SIGINT let the batch in hand finish for up to
`stop_grace_s`, then give its claims back, and exit OK (0; a second signal gives them back at
once); `idle_exit_s` without a request exits OK and frees the device; a failed heartbeat exits
INTERNAL_ERROR (1) without publishing (another worker serves the claims once the lease runs
out); weights that cannot be preloaded exit USAGE (2); a spool write that fails for a full disk
or quota (ENOSPC, EDQUOT, EFBIG; the status file's included) gives back the claims that have no
published result and exits CANNOT_WRITE (74), its log naming the file.

One bad file never stops the worker (errors.py sorts the OSErrors): a request file that cannot
be claimed, read or archived is left in requests/ (given back when it was claimed), logged once
and skipped for a while (skipped.py) while the worker serves the others. ESTALE and EIO are
tried again a few times first. Only the spool itself failing (requests/ unreadable after those
retries, or its filesystem refusing hard links: fsio.LinksUnsupported, which `serve` checks at
start too) stops the worker, with CANNOT_WRITE (74). Nor does one request's answer: a request
asking more than `request_limits` is answered `request_too_large` before the engine sees it, and
an answer that cannot be built, encoded or is too large becomes its request's error result while
the rest of its batch is served (request_limits.py).

Each result's timings say what its engine call spent loading weights: seconds and bytes of
weight files (0 and 0 when they were already loaded). The worker counts into the status file's
counters and its Tally only; the metrics textfile, when asked for, renders those.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field

from protocol import exit_codes
from protocol.fsio import LinksUnsupported
from protocol.messages import ErrorCode, MessageError, Result, WorkerState
from protocol.spool import Claim, ClaimLost, Spool, id_from_name
from protocol.watch import Waker

from .claims import Claims
from .engines import Engine
from .errors import RequestFailed, is_full_disk, retrying
from .metrics import Metrics
from .notify import Notifier
from .request_limits import RequestLimits
from .results import Answers, Job
from .scheduling import Limits, Scheduler, weights_key
from .skipped import Skipped
from .status import Heartbeat, Tally

log = logging.getLogger(__name__)

EXIT_OK = exit_codes.OK
EXIT_PRELOAD_FAILED = exit_codes.USAGE


@dataclass
class WorkerConfig:
    """The worker's settings; `rollout-svc serve` takes its option defaults from here."""

    worker_id: str
    lease_s: float = 30.0  # others recover our claims when our heartbeat stands still this long
    heartbeat_s: float = 2.0
    idle_exit_s: float | None = 7200.0  # None: serve forever
    rescan_s: float = 1.0  # directory scan even without file events
    stop_grace_s: float = 60.0  # after SIGTERM, how long the batch in hand may still run
    limits: Limits = field(default_factory=Limits)
    request_limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask
    poll: bool | None = None  # None: poll only on filesystems without inotify
    preload: str | None = None  # weights to load before the first request
    sleep_when_idle_s: float | None = None  # put the engine to sleep after this long without requests; None: never
    skip_s: float = 10.0  # a request file that failed is tried again after this long (doubling)
    skip_max_s: float = 600.0  # ... up to this long


class _StopNow(BaseException):
    """Raised inside an engine call when the stop grace ran out (BaseException: engines must
    not swallow it)."""


class Worker:
    def __init__(
        self,
        spool: Spool,
        engine: Engine,
        config: WorkerConfig,
        *,
        notifier: Notifier | None = None,
        metrics: Metrics | None = None,
    ):
        self.spool = spool
        self.engine = engine
        self.config = config
        self.notifier = notifier or Notifier({})
        self.metrics = metrics  # renders the counts below into a textfile; counts nothing itself
        self._metrics_failure: str | None = None  # why the textfile was not written last time
        self.tally = Tally()  # with self.heartbeat.status.counters: every count the worker keeps
        self.scheduler = Scheduler(spool, config.limits)
        self.skipped = Skipped(config.skip_s, config.skip_max_s)  # request files that failed, tried again later
        self.heartbeat = Heartbeat(
            spool,
            worker_id=config.worker_id,
            engine=engine.name,
            device=engine.device,
            lease_s=config.lease_s,
            interval_s=config.heartbeat_s,
            on_beat=self.notifier.watchdog,
        )
        self.claims = Claims(spool, config.worker_id, self.heartbeat, self.skipped)
        self.answers = Answers(engine, config.worker_id, config.request_limits, self.heartbeat)
        engine.set_state_listener(self._engine_state)
        self._stopping = False
        self._in_engine = False
        self._waker: Waker | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def request_stop(self, *_signal_args) -> None:
        """First signal: finish the batch in hand within the grace. Second: stop now."""
        if self._stopping and self._in_engine:
            raise _StopNow()
        self._stopping = True
        self.notifier.stopping()
        if self._in_engine:
            self._start_grace()
        if self._waker is not None:
            self._waker.poke()

    def _start_grace(self) -> None:
        signal.alarm(max(1, int(self.config.stop_grace_s)))
        log.warning(
            "stop requested: the batch in hand has %.0f s (--stop-grace) to finish; a second signal gives it back",
            self.config.stop_grace_s,
        )

    def _grace_over(self, *_signal_args) -> None:
        if self._in_engine:
            raise _StopNow()

    def serve(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.request_stop)
        signal.signal(signal.SIGALRM, self._grace_over)
        # Claims under our id are from an earlier life of this worker (same id, e.g. after a
        # crash and a systemd restart): nobody is serving them, so give them back now.
        self.claims.recover_own()
        self.heartbeat.start()
        try:
            if self.config.preload and not self._preload(self.config.preload):
                return EXIT_PRELOAD_FAILED
            with Waker([self.spool.requests], poll=self.config.poll) as self._waker:
                how = "polling" if self._waker.polling else "file events"
                log.info("new requests found by %s and a rescan every %.1f s", how, self.config.rescan_s)
                self.heartbeat.set_state("idle")
                self.notifier.ready(self._describe())
                return self._loop()
        finally:
            self.heartbeat.set_state("stopping")
            self.heartbeat.stop(remove=True)
            self.engine.close()

    def _preload(self, weights_dir: str) -> bool:
        try:
            self.engine.ensure_weights(weights_dir)
        except RequestFailed as exc:
            log.error("cannot preload --weights %s: %s", weights_dir, exc.message)
            return False
        self._engine_state(self._resting())
        return True

    def _loop(self) -> int:
        cfg = self.config
        last_work = time.monotonic()
        next_recovery = 0.0
        sleep_tried = False  # one sleep per idle spell: an engine with nothing to free stays awake
        while not self._stopping:
            if not self.heartbeat.alive():
                return self.claims.heartbeat_lost([])
            now = time.monotonic()
            try:
                if now >= next_recovery:
                    next_recovery = now + cfg.lease_s / 4
                    recovered = retrying(lambda: self.spool.recover_stale(cfg.lease_s), "giving back dead claims")
                    if recovered:
                        log.warning("gave back %d claims of dead workers: %s", len(recovered), recovered[:5])
                pending = retrying(self.spool.pending, f"listing {self.spool.requests}")
            except OSError as exc:
                return self.claims.cannot_write(exc, [])
            self.tally.queue_depth = len(pending)
            self._write_metrics()
            entries = self.skipped.servable(pending)
            # Empty when every pending request is left to the live peer it prefers (scheduling)
            batch = self.scheduler.pick(entries, self.engine.weights_dir, worker_id=cfg.worker_id) if entries else []
            if batch:
                exit_code = self._serve_batch(batch)
                if exit_code is not None:
                    return exit_code
                last_work = time.monotonic()
                sleep_tried = False
                continue
            if cfg.idle_exit_s is not None and now - last_work >= cfg.idle_exit_s:
                log.info("idle for %.0f s; exiting to free the device", now - last_work)
                return EXIT_OK
            if cfg.sleep_when_idle_s is not None and not sleep_tried and now - last_work >= cfg.sleep_when_idle_s:
                sleep_tried = True
                self._sleep(now - last_work)
            sticky = self.scheduler.next_sticky_s if entries else None  # a request left to a peer may become ours
            self._waker.wait(cfg.rescan_s if sticky is None else max(0.0, min(cfg.rescan_s, sticky)))
        log.info("stop requested; exiting")
        return EXIT_OK

    # -- one batch -------------------------------------------------------------------------------

    def _serve_batch(self, entries) -> int | None:
        claims: list[Claim] = []
        try:
            return self._serve_claims(entries, claims)
        except OSError as exc:  # a full disk (one file's failure is handled where it happens)
            return self.claims.cannot_write(exc, claims)

    def _serve_claims(self, entries, claims: list[Claim]) -> int | None:
        jobs: list[Job] = []
        if entries:
            # Busy from the first claim on: a peer that reads "idle" leaves us parts of a call
            # (scheduling's fan-out rule) that we would then serve only after this batch.
            self.heartbeat.set_state("generating", id_from_name(entries[0].name))
        for entry in entries:
            try:
                claim = self.claims.claim(entry)
            except OSError as exc:
                if is_full_disk(exc):
                    raise
                self.skipped.skip(entry.name, entry.path, exc, f"cannot claim requests/{entry.name}")
                continue
            if claim is None:
                continue  # another worker was faster
            claims.append(claim)
            try:
                job = self._accept(claim)
            except OSError as exc:
                if is_full_disk(exc) or isinstance(exc, LinksUnsupported):
                    raise
                self.claims.set_aside([claim], exc, "cannot read or answer")
                continue
            if job is not None:
                jobs.append(job)
        self.scheduler.served(job.request.call_id for job in jobs)
        groups: dict[tuple, list[Job]] = {}
        for job in jobs:
            groups.setdefault(weights_key(job.request), []).append(job)
        pending = list(groups.values())
        while pending:
            group = pending.pop(0)
            try:
                results = self._generate(group)
            except _StopNow:
                log.warning("stop grace over; giving back %d requests", sum(map(len, [group, *pending])))
                for job in [j for g in [group, *pending] for j in g]:
                    self.spool.release(job.claim)
                self.heartbeat.count(requests_abandoned=sum(map(len, [group, *pending])))
                return EXIT_OK
            if not self.heartbeat.alive():
                return self.claims.heartbeat_lost([job.claim for g in [group, *pending] for job in g])
            try:
                self._publish(group, results)
            except OSError as exc:
                if is_full_disk(exc) or isinstance(exc, LinksUnsupported):  # the spool's failure, not one file's
                    raise
                self.claims.set_aside([job.claim for job in group], exc, "cannot publish the result of")
        self._engine_state(self._resting())
        return None

    def _accept(self, claim: Claim) -> Job | None:
        """Validate a fresh claim. Bad input is answered and archived here; None means done."""
        claimed_at = time.time()
        try:
            request = retrying(lambda: self.spool.load(claim), f"reading {claim.path}")
        except ClaimLost as exc:
            log.warning("%s", exc)
            self.heartbeat.count(requests_abandoned=1)
            return None
        except MessageError as exc:
            log.warning("rejected %s: %s", claim.name, exc.message)
            retrying(lambda e=exc: self.spool.reject(claim, e, self.config.worker_id), f"rejecting {claim.path}")
            self._count_failure(exc.code)
            self.heartbeat.update(last_error=f"{claim.name}: {exc.message}")
            return None
        if self.spool.has_result(request.request_id):
            # Served before: a duplicate delivery after a lease recovery. First result stands.
            self.spool.finish(claim)
            return None
        job = Job(claim, request, claimed_at)
        if request.deadline is not None and claimed_at > request.deadline:
            late = claimed_at - request.deadline
            message = (
                f"deadline passed {late:.1f} s before a worker could start it; "
                "resubmit with a later deadline or add workers"
            )
            self._publish([job], [self.answers.failure(job, ErrorCode.DEADLINE_EXPIRED, message)])
            return None
        too_large = self.config.request_limits.refusal(request)
        if too_large is not None:
            self._publish([job], [self.answers.failure(job, ErrorCode.REQUEST_TOO_LARGE, too_large)])
            return None
        return job

    def _generate(self, group: list[Job]) -> list[Result]:
        """Serve a group in one engine call. If the call fails, serve each request alone, so
        that one bad request does not fail the others."""
        self.heartbeat.set_state("generating", group[0].request.request_id)
        started = time.monotonic()
        was_asleep = self.engine.asleep
        try:
            self._in_engine = True
            if self._stopping:  # a stop arrived just before this engine call: the grace applies here too
                self._start_grace()
            self.heartbeat.count(engine_calls=1)
            completions = self.engine.generate([job.request for job in group])
        except Exception as exc:
            if len(group) == 1:
                return [self.answers.error_result(group[0], exc)]
            return [r for job in group for r in self._generate([job])]
        finally:
            self._in_engine = False
            signal.alarm(0)
            self._count_wake(was_asleep)
        generate_s = time.monotonic() - started
        try:
            results = [self.answers.success(job, c, generate_s) for job, c in zip(group, completions, strict=True)]
        except Exception as exc:  # an answer that cannot be built fails its request alone, not the batch
            if len(group) == 1:
                return [self.answers.error_result(group[0], exc)]
            return [r for job in group for r in self._generate([job])]
        tokens = sum(len(t) for r in results for p in r.token_ids for t in p)
        reload_s = completions[0].reload_s if completions else 0.0  # one load per call, before generating
        generation_s = max(generate_s - reload_s, 1e-9)
        self.tally.tokens_per_s = tokens / generation_s
        self.tally.generation_seconds += generation_s
        if completions and (reload_s or completions[0].reload_bytes):
            self.tally.reloads += 1
            self.tally.reload_s = reload_s
            self.tally.reloading_seconds += reload_s
        return results

    def _publish(self, group: list[Job], results: list[Result]) -> None:
        held = [
            (job, self.answers.publishable(job, result))
            for job, result in zip(group, results, strict=True)
            if self.spool.holds(job.claim)
        ]
        lost = len(group) - len(held)
        if lost:
            # Recovered while we worked: the request is back in requests/ and someone else
            # owns it now. A worker publishes only for claims it still holds.
            log.warning("%d claims were taken back during generation; not publishing them", lost)
            self.heartbeat.count(requests_abandoned=lost)
        retrying(lambda: self.spool.publish_results([r for _, r in held]), "publishing results")
        for job, result in held:
            rejected = not result.ok and result.error.code.rejects_input
            retrying(lambda j=job, r=rejected: self.spool.finish(j.claim, rejected=r), f"archiving {job.claim.path}")
            if result.ok:
                samples = sum(len(s) for s in result.texts)
                tokens = sum(len(t) for per_prompt in result.token_ids for t in per_prompt)
                self.heartbeat.count(requests_ok=1, samples=samples, tokens=tokens)
            else:
                self._count_failure(result.error.code)

    # -- sleep -----------------------------------------------------------------------------------

    def _sleep(self, idle_s: float) -> None:
        """Give the device memory back until the next request; if the engine cannot sleep, close
        it instead (the device is freed either way; the next request builds a new engine)."""
        try:
            seconds = self.engine.sleep()
        except Exception:
            log.exception("the engine could not sleep; closing it to free the device")
            self.engine.close()
            self._engine_state(self._resting())
            return
        if not self.engine.asleep:
            return  # nothing loaded, nothing to free
        self.tally.sleeps += 1
        self.tally.sleep_s = seconds
        self.tally.asleep = True
        log.info("no request for %.0f s: engine asleep (%.2f s to fall asleep), device memory free", idle_s, seconds)
        self._engine_state(self._resting())

    def _count_wake(self, was_asleep: bool) -> None:
        if was_asleep and not self.engine.asleep:
            self.tally.wakes += 1
            self.tally.wake_s = self.engine.last_wake_s
        self.tally.asleep = self.engine.asleep

    def _resting(self) -> WorkerState:
        """The state between requests: asleep or idle."""
        return "sleeping" if self.engine.asleep else "idle"

    # -- status ----------------------------------------------------------------------------------

    def _count_failure(self, code: ErrorCode) -> None:
        self.heartbeat.count(requests_failed=1)
        self.tally.errors[code.value] += 1

    def _write_metrics(self) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.write(self.heartbeat.status.counters, self.tally)
        except OSError as exc:  # monitoring must not stop the service
            if str(exc) != self._metrics_failure:  # once per failure, not at every loop turn
                log.warning("metrics textfile %s not written: %s; serving on", self.metrics.path, exc)
            self._metrics_failure = str(exc)
            return
        if self._metrics_failure is not None:
            log.info("metrics textfile %s written again", self.metrics.path)
            self._metrics_failure = None

    def _engine_state(self, state: WorkerState) -> None:
        """Engines report loading/reloading/generating; mirror it in the status and systemd."""
        current = self.heartbeat.status.current_request if state in ("reloading", "loading", "generating") else None
        self.heartbeat.update(
            state=state,
            current_request=current,
            weights_dir=self.engine.weights_dir,
            weights_content_id=self.engine.weights_content_id,
            engine_build_s=self.engine.build_s or None,
        )
        self.notifier.status(self._describe())

    def _describe(self) -> str:
        s = self.heartbeat.status
        weights = s.weights_dir or "no weights loaded"
        doing = f" {s.current_request}" if s.current_request else ""
        return f"{s.state}{doing}; {weights}; ok {s.counters.requests_ok}, failed {s.counters.requests_failed}"
