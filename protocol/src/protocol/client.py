"""The producer's side of the spool: submit requests, wait for their results, never hang.

    with SpoolClient("/srv/spool") as client:
        client.submit(request)
        results = client.wait([request.request_id], timeout_s=600)

`wait` returns when every result is there. It raises `NoLiveWorker` within
`no_worker_grace_s` when no worker heartbeat is fresh, and `ResultTimeout` at the deadline;
both messages say which requests are pending and what to do. No file in the spool makes it
block past its deadline: a result file that is a FIFO, a link, too large or not a result is
that request's `bad_result` error (its message names the file), and status files that do not
read count as no worker. A spool on a filesystem without hard links or atomic rename is refused
when the client is made (spool_filesystem.SpoolUnsupported).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from .messages import ErrorCode, Request, Result
from .spool import DEFAULT_LEASE_S, Spool, id_from_name, name_for_id, split_claimed_name
from .spool_filesystem import check_filesystem
from .watch import Waker


class WaitError(RuntimeError):
    """A wait that ended without all results. `pending` lists the ids still missing."""

    def __init__(self, message: str, pending: list[str]):
        super().__init__(message)
        self.pending = pending


class NoLiveWorker(WaitError):
    """No worker has a fresh heartbeat, so nothing will serve the pending requests."""


class ResultTimeout(WaitError):
    """The deadline passed while workers were alive."""


class WorkerAbsence:
    """How long a waiting producer has seen no live worker, against a grace: a worker that is starting
    writes its status within a second or two, so a short absence is no error. One absence is seen at two
    checks at least, however short the grace. Shared by `SpoolClient.wait` and other waiters."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.since: float | None = None  # monotonic time of the first check that saw none; None: one lives

    def too_long(self, alive: bool, now: float) -> bool:
        """Record a check at `now` that saw a live worker (or had nothing waiting): `alive`; True once
        none has been seen for `grace_s`."""
        if alive:
            self.since = None
        elif self.since is None:
            self.since = now
        else:
            return now - self.since >= self.grace_s
        return False


class SpoolClient:
    def __init__(
        self,
        root: str | Path,
        *,
        create: bool = True,
        poll: bool | None = None,
        rescan_s: float = 1.0,
        no_worker_grace_s: float = 10.0,
        recover_stale: bool = True,
    ):
        """`no_worker_grace_s`: how long a wait tolerates having no live worker (a worker that
        is starting writes its status within a second or two). `recover_stale`: while waiting,
        also give back claims of dead workers, so a wait does not depend on another worker's
        scan."""
        self.spool = Spool(root, create=create)
        check_filesystem(self.spool.root)  # SpoolUnsupported where links or renames do not work
        self.poll = poll
        self.rescan_s = rescan_s
        self.no_worker_grace_s = no_worker_grace_s
        self.recover_stale = recover_stale
        self._waker: Waker | None = None

    def submit(self, request: Request) -> None:
        self.spool.submit(request)

    def submit_many(self, requests: list[Request]) -> None:
        self.spool.submit_many(requests)

    def submit_missing(self, requests: list[Request]) -> list[Request]:
        """Submit those of `requests` the spool holds in no state; returns them (Spool.submit_missing)."""
        return self.spool.submit_missing(requests)

    def close(self) -> None:
        if self._waker is not None:
            self._waker.__exit__(None, None, None)
            self._waker = None

    def __enter__(self) -> SpoolClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _wake_on_results(self) -> Waker:
        # Started once and kept: a watch costs a thread start, too much for every wait.
        if self._waker is None:
            self._waker = Waker([self.spool.results], poll=self.poll).__enter__()
        return self._waker

    def wait(
        self,
        request_ids: list[str],
        timeout_s: float,
        *,
        consume: bool = True,
        on_poll: Callable[[], None] | None = None,
    ) -> dict[str, Result]:
        """Block until each id has a result, and return them by id.

        With `consume`, each result is moved to done/ once read, so results/ holds only
        unread results. Raises NoLiveWorker or ResultTimeout (see the module docstring).
        `on_poll` is called about once a second and may raise to end the wait (for instance
        when a worker process the caller started has died).
        """
        waker = self._wake_on_results()
        deadline = time.monotonic() + timeout_s
        pending = set(request_ids)
        results: dict[str, Result] = {}
        absence = WorkerAbsence(self.no_worker_grace_s)
        next_full_check = 0.0
        while True:
            now = time.monotonic()
            full_check = now >= next_full_check
            # Results are found in listings, never by opening a name that may not exist yet: a
            # host that looked up an absent name can go on seeing it absent (negative caches).
            if full_check:
                # Also looks in done/ (a result consumed earlier) and does the liveness work.
                next_full_check = now + min(1.0, self.rescan_s)
                found = self.spool.read_results(list(pending))
            else:
                published = set(os.listdir(self.spool.results))
                candidates = [i for i in pending if name_for_id(i) in published]
                found = self.spool.read_results(candidates, {"results": published, "done": set()}) if candidates else {}
            for request_id, result in found.items():
                results[request_id] = result
                pending.discard(request_id)
                if consume and (result.ok or result.error.code != ErrorCode.BAD_RESULT):
                    self.spool.consume_result(request_id)  # a bad_result's file stays for an operator
            if not pending:
                return results
            waiting = sorted(pending)
            if now >= deadline and not self.spool.live_workers():
                raise NoLiveWorker(
                    f"{len(pending)} results missing after {timeout_s:.0f} s and no live rollout worker "
                    f"serves {self.spool.root}: {self.describe(waiting)}. Start one with "
                    f"`rollout-svc serve --spool {self.spool.root}` or `systemctl start rollout-svc@0`.",
                    waiting,
                )
            if now >= deadline:
                raise ResultTimeout(
                    f"{len(pending)} of {len(set(request_ids))} results missing after {timeout_s:.0f} s "
                    f"in {self.spool.root}: {self.describe(waiting)}. Workers are alive; "
                    "raise the timeout, or check `spoolctl stats` for a stuck worker.",
                    waiting,
                )
            if full_check:
                if on_poll is not None:
                    on_poll()
                if self.recover_stale:
                    self.spool.recover_stale(DEFAULT_LEASE_S)
                if absence.too_long(bool(self.spool.live_workers()), now):
                    raise NoLiveWorker(
                        f"no live rollout worker serves {self.spool.root} (no fresh heartbeat in "
                        f"{self.spool.workers} for {self.no_worker_grace_s:.0f} s); "
                        f"{len(pending)} requests wait: {self.describe(waiting)}. Start one with "
                        f"`rollout-svc serve --spool {self.spool.root}` or "
                        "`systemctl start rollout-svc@0`.",
                        waiting,
                    )
            waker.wait(min(self.rescan_s, max(0.0, deadline - now), 1.0))

    def describe(self, request_ids: list[str], limit: int = 5) -> str:
        """Where each of the first `limit` ids is: done, queued, claimed by whom, or missing.
        From listings, and done/ by name, like `wait`: a lookup by name of a result not yet
        written would hide it from this host for as long as its negative cache lasts."""
        claimed = {}
        for entry in self.spool.entries("claimed"):
            original, worker_id = split_claimed_name(entry.name)
            claimed[id_from_name(original)] = worker_id
        queued = set(os.listdir(self.spool.requests))
        published = set(os.listdir(self.spool.results))
        parts = []
        for request_id in request_ids[:limit]:
            if name_for_id(request_id) in published or os.path.lexists(self.spool.consumed_result_path(request_id)):
                parts.append(f"{request_id} (done)")
            elif request_id in claimed:
                parts.append(f"{request_id} (claimed by {claimed[request_id]})")
            elif name_for_id(request_id) in queued:
                parts.append(f"{request_id} (queued)")
            else:
                parts.append(f"{request_id} (not in the spool)")
        more = len(request_ids) - limit
        return ", ".join(parts) + (f" and {more} more" if more > 0 else "")
