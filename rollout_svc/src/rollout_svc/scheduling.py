"""What to claim next: requests for the weights already loaded first, with aging.

A weight change costs a reload (seconds) or a rebuild (tens of seconds), so a worker serves
what it can with the weights it holds before switching. To keep that from starving anyone, a
request waiting longer than `max_wait_s` is served next whatever its weights. Requests that
cannot be served at all (unreadable, expired) are claimed first: answering them is cheap.

Fan-out is a rule: the parts of one call (requests with the same `call_id`) go to different idle
workers. A worker takes only its share of a call's pending parts: the parts divided among itself
and the other live workers whose status says idle or sleeping, rounded up. With a part per
worker, the first to scan takes one part and leaves the others to its idle peers. A worker whose
peers are busy or gone takes all that is left. A worker that finds parts of a call still pending
after it served its share takes all of them: its idle peers had a whole engine call's time to come,
so peers that look idle but never come (frozen, or SIGKILLed within their lease) cost the call
one more engine call of this worker, whatever the number of parts and of such peers.
Status files are read only when a call has several parts pending, and only until enough idle
peers are found to bring the share down to one part.

Stickiness: a request naming a `prefer_worker` other than this worker is left to that worker
while its heartbeat is fresh and the request has waited less than `sticky_wait_s` since it was
written (its file's mtime); it is taken at once when that worker is dead or has no status file,
and by any worker once the wait is over, so a busy or frozen preferred worker delays it by at
most `sticky_wait_s` and never starves it. A worker serves the requests that prefer it before
the others of the same weights. Status files are read once per pick, and only when a pending
request prefers another worker. `next_sticky_s` says when the next request left to a peer
becomes this worker's, so that the worker waits that long at most before it looks again.

The pick reads request files before claiming them. That is safe: files in requests/ are
complete by contract, and the authoritative read happens again after the claim.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from protocol.fsio import read_regular_file
from protocol.messages import MessageError, Request, decode_request
from protocol.spool import MAX_REQUEST_BYTES, Entry, Spool, id_from_name


@dataclass(frozen=True)
class Limits:
    max_requests: int = 64  # requests claimed per batch
    max_sequences: int = 4096  # completions (prompts x samples) per engine call
    max_wait_s: float = 60.0  # a request older than this is served next, whatever its weights
    sticky_wait_s: float = 2.0  # a request preferring another live worker is left to it this long


def weights_key(request: Request) -> tuple[str, str | None]:
    """Requests with equal keys share one engine call (vLLM takes per-prompt sampling settings)."""
    return (request.weights_dir, request.weights_content_id)


class Scheduler:
    def __init__(self, spool: Spool, limits: Limits | None = None):
        self.spool = spool
        self.limits = limits or Limits()
        self._peeked: dict[tuple[str, float, int], Request | None] = {}
        self._shared: set[str] = set()  # calls this worker served a share of that still have parts pending
        self.next_sticky_s: float | None = None  # from the last pick: seconds until a request left to a peer is ours

    def pick(
        self,
        entries: list[Entry],
        loaded_weights_dir: str | None,
        now: float | None = None,
        *,
        worker_id: str | None = None,
    ) -> list[Entry]:
        """Entries to claim now, from `entries` (oldest first, as Spool.pending returns).
        `worker_id`: the picking worker, whose own status file does not count as an idle peer."""
        self.next_sticky_s = None
        if not entries:
            self._shared.clear()
            return []
        now = time.time() if now is None else now
        peeked = [(entry, self._peek(entry)) for entry in entries]
        self._peeked = {(e.name, e.mtime, e.size): r for e, r in peeked}  # forget entries gone
        self._shared &= {r.call_id for _, r in peeked if r is not None}  # and calls with no part pending
        answer_now = [e for e, r in peeked if r is None or (r.deadline is not None and r.deadline < now)]
        if answer_now:
            return answer_now[: self.limits.max_requests]
        peeked = self._not_left_to_peers(peeked, now, worker_id)
        if not peeked:
            return []
        oldest_entry, oldest = peeked[0]
        target = weights_key(oldest)
        if loaded_weights_dir is not None and now - oldest_entry.mtime < self.limits.max_wait_s:
            for _, request in peeked:
                if request.weights_dir == loaded_weights_dir:
                    target = weights_key(request)
                    break
        candidates = [(entry, request) for entry, request in peeked if weights_key(request) == target]
        if worker_id is not None:  # those preferring this worker first (a stable sort keeps their age order)
            candidates.sort(key=lambda pair: pair[1].prefer_worker != worker_id)
        shares = self._shares([request for _, request in candidates], worker_id)
        batch, sequences, taken = [], 0, Counter()
        for entry, request in candidates:
            if request.call_id is not None and taken[request.call_id] >= shares[request.call_id]:
                continue  # left for an idle peer
            full = len(batch) >= self.limits.max_requests
            if batch and (full or sequences + request.num_sequences > self.limits.max_sequences):
                break
            batch.append(entry)
            sequences += request.num_sequences
            taken[request.call_id] += 1
        return batch

    def _not_left_to_peers(self, peeked: list, now: float, worker_id: str | None) -> list:
        """`peeked` without the requests left to the live peer they prefer (module docstring);
        sets `next_sticky_s` from those left."""
        preferring_peers = [(e, r) for e, r in peeked if r.prefer_worker not in (None, worker_id)]
        waiting = [(e, r) for e, r in preferring_peers if now - e.mtime < self.limits.sticky_wait_s]
        if not waiting:
            return peeked
        live = {status.worker_id for status in self.spool.live_workers()}
        left = {e.name for e, r in waiting if r.prefer_worker in live}
        if left:
            self.next_sticky_s = min(e.mtime + self.limits.sticky_wait_s - now for e, _ in waiting if e.name in left)
        return [(e, r) for e, r in peeked if e.name not in left]

    def served(self, call_ids) -> None:
        """Record the calls whose parts this worker claimed and serves now: parts of them still
        pending at a later pick are all its (not a claim lost to a faster peer, which leaves the
        share rule as it was)."""
        self._shared.update(call for call in call_ids if call is not None)

    def _shares(self, requests: list[Request], worker_id: str | None) -> Counter[str]:
        """How many pending parts of each call this worker takes now: its share of them among
        itself and the idle peers, rounded up (at least one, so the call always moves on); all
        of them for a call it took a share of before."""
        parts = Counter(request.call_id for request in requests if request.call_id is not None)
        most = max((n for call, n in parts.items() if call not in self._shared), default=0)
        if most < 2:
            return parts
        # More idle peers than a call's parts minus one cannot make a share smaller than one part.
        idle = len(self.spool.idle_peers(worker_id, enough=most - 1))
        return Counter({call: n if call in self._shared else -(-n // (idle + 1)) for call, n in parts.items()})

    def _peek(self, entry: Entry) -> Request | None:
        """The request an entry holds, or None when it cannot be accepted as it is."""
        key = (entry.name, entry.mtime, entry.size)
        if key in self._peeked:
            return self._peeked[key]
        request = None
        if id_from_name(entry.name) is not None and 0 < entry.size <= MAX_REQUEST_BYTES:
            try:
                request = decode_request(read_regular_file(entry.path, MAX_REQUEST_BYTES))
            except (OSError, ValueError, MessageError):  # symlinks and directories included
                request = None
            if request is not None and request.request_id != id_from_name(entry.name):
                request = None  # will get id_mismatch: answer it now
        self._peeked[key] = request
        return request
