"""The results a worker publishes: one per request, built from its engine's completion or its error.

Guarantees:
- A result names the weights the engine served (`weights_dir` and content id: an adapter's when
  one was served) or, when nothing was served, the request's `weights_dir`; the worker and engine;
  and timings (queued, reload seconds and bytes, generation without the reload).
- A RequestFailed becomes its own code and message; any other exception `engine_error`, naming its
  type and pointing at the worker's log, which holds the traceback.
- A result that cannot be encoded or is too large (request_limits) becomes its request's error
  result, so one answer never fails the publishing of its batch. Each failure is the status
  file's `last_error`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from protocol.messages import ErrorCode, Request, Result, Timings
from protocol.spool import Claim

from .engines import Completion, Engine
from .errors import RequestFailed
from .request_limits import RequestLimits
from .status import Heartbeat

log = logging.getLogger(__name__)


@dataclass
class Job:
    """Results of the engine `engine` on the worker `worker_id`; failures noted in `heartbeat`."""

    claim: Claim
    request: Request
    claimed_at: float

    @property
    def queued_s(self) -> float:
        """From the request file's write to our claim."""
        return max(0.0, self.claimed_at - self.claim.arrived_at)


@dataclass
class Answers:
    engine: Engine
    worker_id: str
    request_limits: RequestLimits
    heartbeat: Heartbeat

    def _common(self, job: Job) -> dict:
        return dict(
            request_id=job.request.request_id,
            weights_dir=self.engine.weights_dir or job.request.weights_dir,
            weights_content_id=self.engine.weights_content_id or "",
            worker_id=self.worker_id,
            engine=self.engine.name,
            finished_at=time.time(),
        )

    def success(self, job: Job, c: Completion, generate_s: float) -> Result:
        return Result(
            ok=True,
            texts=c.texts,
            token_ids=c.token_ids,
            logprobs=c.logprobs if job.request.logprobs else [],
            finish_reasons=c.finish_reasons,
            prompt_token_ids=c.prompt_token_ids,
            prompt_cached_tokens=c.cached_tokens,
            timings=Timings(
                queued_s=job.queued_s,
                reload_s=c.reload_s,
                reload_bytes=c.reload_bytes,
                generate_s=generate_s - c.reload_s,
            ),
            **self._common(job),
        )

    def failure(self, job: Job, code: ErrorCode, message: str) -> Result:
        self.heartbeat.update(last_error=f"{job.request.request_id}: {message}")
        timings = Timings(queued_s=job.queued_s)
        return Result.failure(code=code, message=message, timings=timings, **self._common(job))

    def publishable(self, job: Job, result: Result) -> Result:
        """`result`, or its request's error result when it cannot be encoded or is too large
        (request_limits): one request's answer never fails the publishing of its batch."""
        problem = self.request_limits.unpublishable(result)
        if problem is None:
            return result
        log.error("result of %s not published as it is: %s", job.request.request_id, problem[1])
        return self.failure(job, *problem)

    def error_result(self, job: Job, exc: Exception) -> Result:
        if isinstance(exc, RequestFailed):
            return self.failure(job, exc.code, exc.message)
        log.exception("engine failed on %s", job.request.request_id)
        message = f"{type(exc).__name__}: {exc} (the log of worker {self.worker_id} has the traceback)"
        return self.failure(job, ErrorCode.ENGINE_ERROR, message)
