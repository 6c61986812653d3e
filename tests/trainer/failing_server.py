"""A spool worker stand-in that fails the requests a test chooses, as a worker does whose engine
failed (engine_error) or that refuses a request (weights_not_allowed...): an error result in
results/, the request archived. The others are served as spool_server.SpoolServer serves them
(the deterministic test sampler), or echoed (`echo=True`: no model, for spool-level tests)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from spool_server import SpoolServer

from protocol.messages import ErrorCode, Request, Result

Verdict = Callable[[Request], ErrorCode | None]  # the error a request gets; None: served


class FailingSpoolServer(SpoolServer):
    def __init__(self, spool_dir: Path, cfg, fail: Verdict, *, echo: bool = False, worker_id: str = "failing"):
        super().__init__(spool_dir, cfg, worker_id=worker_id)
        self.fail = fail
        self.echo = echo
        self.answered: list[str] = []  # ids answered, in order, each before its result is published
        self.failed: list[str] = []  # those answered with an error

    def serve(self, request: Request) -> Result:
        self.answered.append(request.request_id)
        code = self.fail(request)
        if code is not None:
            self.failed.append(request.request_id)
            return Result.failure(
                request.request_id,
                code,
                f"{code.value} made by the test",
                worker_id=self.worker_id,
                finished_at=time.time(),
            )
        return self._echo(request) if self.echo else super().serve(request)

    def _echo(self, request: Request) -> Result:
        # Token ids are code points, as the echo engine's: prompts given as ids are echoed as ids.
        prompt_ids = request.prompt_token_ids or [[ord(c) for c in p] for p in request.prompts]
        kept = [ids[: request.max_tokens] for ids in prompt_ids]
        n = request.n_samples_per_prompt
        return Result(
            request_id=request.request_id,
            ok=True,
            texts=[["".join(map(chr, k))] * n for k in kept],
            token_ids=[[k] * n for k in kept],
            logprobs=[[[0.0] * len(k)] * n for k in kept],
            finish_reasons=[["length" if len(ids) > request.max_tokens else "stop"] * n for ids in prompt_ids],
            prompt_token_ids=prompt_ids,
            weights_dir=request.weights_dir,
            worker_id=self.worker_id,
            finished_at=time.time(),
        )


def first(count: int, code: ErrorCode, where: Callable[[Request], bool] = lambda request: True) -> Verdict:
    """Fail the first `count` requests `where` picks with `code`; serve every other."""
    left = [count]

    def verdict(request: Request) -> ErrorCode | None:
        if left[0] and where(request):
            left[0] -= 1
            return code
        return None

    return verdict
