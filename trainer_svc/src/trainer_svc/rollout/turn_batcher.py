"""The turns of many episodes, sent through the spool in batches: one request per target worker
carrying many prompts, so the spool's request rate follows the number of workers, not the
number of episodes in flight.

    batcher = TurnBatcher(client, weights_dir=..., weights_content_id=..., max_tokens=64,
                          temperature=1.0, top_p=1.0, stop=[])
    batcher.put(Turn("ep7.t0", prompt_ids, seed=11, prefer_worker=None))
    for outcome in batcher.poll(timeout_s=1.0): ...

Guarantees:
- Turns put together go out together: at the first `poll` after the oldest queued turn has waited
  `max_wait_s` (or once `max_prompts_per_request` turns are queued), every queued turn is sent,
  grouped by weights and target worker, at most `max_prompts_per_request` prompts a request, all
  the requests of one send published with one directory fsync.
- A turn's target is the worker it prefers when that worker is alive; turns with no live
  preference are spread over the live workers, each going to the one with the fewest prompts in
  flight. A request names its target in `prefer_worker`, so the target serves it while it lives
  (the spool's sticky rule: others take it once it is dead, or after their `--sticky-wait-s`).
- Turns of one request share their weights and their temperature (a greedy eval's turns travel
  beside a run's sampled ones, in requests of their own).
- Each prompt carries its turn's seed in `prompt_seeds`, so a turn samples the same whichever
  request and position it travels in (turns without a seed travel in requests of their own
  kind, unseeded). One sample per prompt (n_samples_per_prompt = 1: the G episodes of a row are
  G turns).
- Every turn put is returned exactly once, as a TurnOutcome with its key: a request whose worker
  died holding it (its claim's worker has no live heartbeat), or that failed with a transient
  error (ErrorCode.transient), is sent again under a fresh request id, to any worker, at most
  `error_retries` times for the turns of a request (then RolloutUnavailable). A late result of
  a request sent again is consumed and dropped. A permanent error raises RolloutFailed naming
  the turn keys, the request and the error.
- No live worker for the SpoolClient's `no_worker_grace_s` while turns are pending raises
  RolloutUnavailable naming what waits: never a hang.
- Request ids are `<tag>-<random nonce of this batcher>-<counter>`: fresh for every request,
  sent again included (a turn's identity is its key, not its request id).

One thread uses a batcher at a time; `put`, `poll` and `pending` hold a lock, so several may.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from protocol.client import SpoolClient, WorkerAbsence
from protocol.messages import ErrorCode, Request, Result, is_valid_id
from protocol.spool import name_for_id, split_claimed_name
from protocol.watch import Waker

from ..rollout_types import RolloutFailed, RolloutUnavailable, split_sizes

log = logging.getLogger(__name__)

CHECK_S = 1.0  # how often the live workers and the claims of requests in flight are looked at


@dataclass(frozen=True)
class Turn:
    key: str  # stable and unique: "<episode id>.t<turn index>"; a resend gets a fresh request id
    prompt_token_ids: list[int]  # the whole prompt, exactly as the engine must see it
    seed: int | None  # this turn's sampling seed
    prefer_worker: str | None  # the worker that served this episode's previous turn
    temperature: float | None = None  # this turn's sampling temperature; None: the batcher's


@dataclass(frozen=True)
class TurnOutcome:
    key: str
    token_ids: list[int]  # engine's completion ids
    logprobs: list[float]  # engine's sampling logprob per completion token
    finish_reason: str  # "stop" | "length"
    text: str  # engine's detokenized completion
    worker_id: str
    weights_content_id: str
    cached_tokens: int | None = None  # prompt tokens the worker's prefix cache served; None: not said
    engine_s: float = 0.0  # the engine's time for the whole request this turn travelled in


@dataclass(frozen=True)
class _Weights:
    dir: str
    content_id: str | None


@dataclass
class _Queued:
    turn: Turn
    weights: _Weights
    put_at: float  # monotonic


@dataclass
class _InFlight:
    request_id: str
    turns: list[Turn]
    weights: _Weights
    target: str | None  # the worker it was meant for (None: no live worker when sent)
    tries: int = 0  # times these turns were sent again
    sent_at: float = field(default_factory=time.monotonic)


class TurnBatcher:
    def __init__(
        self,
        client: SpoolClient,
        *,
        weights_dir: str,
        weights_content_id: str | None,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop: list[str],
        max_wait_s: float = 0.05,
        max_prompts_per_request: int = 256,
        tag: str = "turn",
        error_retries: int = 3,
    ):
        if max_prompts_per_request < 1:
            raise ValueError(f"max_prompts_per_request must be >= 1, got {max_prompts_per_request}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        if not is_valid_id(f"{tag}-x"):
            raise ValueError(f"tag {tag!r} cannot start a request id: use letters, digits and . _ - only")
        self.client = client
        self.spool = client.spool
        self.max_tokens, self.temperature, self.top_p, self.stop = max_tokens, temperature, top_p, list(stop)
        self.max_wait_s = max_wait_s
        self.max_prompts_per_request = max_prompts_per_request
        self.tag = tag
        self.error_retries = error_retries
        self.requests_sent = 0  # request files this batcher published, resends included
        self.turns_sent = 0  # prompts those requests carried
        self.resent = 0  # requests sent again (dead worker or transient error)
        self._weights = _Weights(weights_dir, weights_content_id)
        self._lock = threading.RLock()
        self._queue: list[_Queued] = []
        self._in_flight: dict[str, _InFlight] = {}
        self._keys: set[str] = set()  # turns put and not returned
        self._abandoned: set[str] = set()  # ids sent again under another id: their late results are dropped
        self._nonce = secrets.token_hex(4)
        self._counter = 0
        self._live: list[str] = []
        self._next_check = 0.0
        self._absence = WorkerAbsence(client.no_worker_grace_s)
        self._waker: Waker | None = None

    # -- the interface -----------------------------------------------------------------------------

    def set_weights(self, weights_dir: str, weights_content_id: str | None) -> None:
        """The weights of the turns put from now on (those queued keep theirs)."""
        with self._lock:
            self._weights = _Weights(weights_dir, weights_content_id)

    def put(self, turn: Turn) -> None:
        """Queue a ready turn; returns at once (a later `poll` sends it)."""
        with self._lock:
            if turn.key in self._keys:
                raise ValueError(f"turn {turn.key!r} is already pending; give each turn its own key")
            if not turn.prompt_token_ids or min(turn.prompt_token_ids) < 0:
                raise ValueError(f"turn {turn.key!r}: prompt_token_ids must be non-empty and hold ids >= 0")
            self._keys.add(turn.key)
            self._queue.append(_Queued(turn, self._weights, time.monotonic()))

    def poll(self, timeout_s: float) -> list[TurnOutcome]:
        """Send what is due, then return the outcomes that arrived: as soon as there are some,
        or empty after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                now = time.monotonic()
                self._send_due(now)
                outcomes = self._collect()
                if outcomes or now >= deadline or not self._keys:
                    return outcomes
                if now >= self._next_check:
                    self._check_workers(now)
                wake = min(deadline, self._next_check)
                if self._queue:
                    wake = min(wake, self._queue[0].put_at + self.max_wait_s)
            self._results_waker().wait(max(0.0, wake - time.monotonic()))

    def pending(self) -> int:
        """Turns put and not yet returned."""
        with self._lock:
            return len(self._keys)

    def close(self) -> None:
        """Stop watching results/. Requests still in flight stay in the spool."""
        if self._waker is not None:
            self._waker.__exit__(None, None, None)
            self._waker = None

    # -- sending -----------------------------------------------------------------------------------

    def _send_due(self, now: float) -> None:
        if not self._queue:
            return
        due = now - self._queue[0].put_at >= self.max_wait_s or len(self._queue) >= self.max_prompts_per_request
        if not due:
            return
        queued, self._queue = self._queue, []
        live = self._live_workers(now)
        load = Counter({worker: 0 for worker in live})
        for flight in self._in_flight.values():
            if flight.target in load:
                load[flight.target] += len(flight.turns)
        groups: dict[tuple[_Weights, float | None, str | None, bool], list[Turn]] = {}
        preferred = [q for q in queued if q.turn.prefer_worker in load]
        for q in preferred:
            load[q.turn.prefer_worker] += 1
        targets = {id(q): q.turn.prefer_worker for q in preferred}
        for q in queued:
            if id(q) not in targets:
                target = min(live, key=lambda w: load[w]) if live else None
                if target is not None:
                    load[target] += 1
                targets[id(q)] = target
        for q in queued:
            key = (q.weights, q.turn.temperature, targets[id(q)], q.turn.seed is None)
            groups.setdefault(key, []).append(q.turn)
        flights = []
        for (weights, _, target, _), turns in groups.items():
            # parts of even size, not full ones and a remainder
            start = 0
            for size in split_sizes(len(turns), math.ceil(len(turns) / self.max_prompts_per_request)):
                flights.append(_InFlight(self._next_id(), turns[start : start + size], weights, target))
                start += size
        self._submit(flights)

    def _submit(self, flights: list[_InFlight]) -> None:
        self.client.submit_many([self._request(flight) for flight in flights])
        for flight in flights:
            self._in_flight[flight.request_id] = flight
        self.requests_sent += len(flights)
        self.turns_sent += sum(len(flight.turns) for flight in flights)

    def _request(self, flight: _InFlight) -> Request:
        return Request(
            request_id=flight.request_id,
            weights_dir=flight.weights.dir,
            weights_content_id=flight.weights.content_id,
            prompt_token_ids=[list(turn.prompt_token_ids) for turn in flight.turns],
            n_samples_per_prompt=1,
            max_tokens=self.max_tokens,
            temperature=self.temperature if flight.turns[0].temperature is None else flight.turns[0].temperature,
            top_p=self.top_p,
            stop=self.stop,
            logprobs=True,
            tag=self.tag,
            prefer_worker=flight.target,
            prompt_seeds=None if flight.turns[0].seed is None else [turn.seed for turn in flight.turns],
        )

    def _next_id(self) -> str:
        self._counter += 1
        return f"{self.tag}-{self._nonce}-{self._counter:08d}"

    def _send_again(self, flights: list[_InFlight], why: str) -> None:
        """Send the turns of `flights` again, each under a fresh id, to any worker."""
        again = []
        for flight in flights:
            if flight.tries >= self.error_retries:
                raise RolloutUnavailable(
                    f"turns {_keys(flight.turns)} were sent {flight.tries + 1} times and failed each time; the last, "
                    f"request {flight.request_id}: {why}. Check the workers (`spoolctl stats -s {self.spool.root}`), "
                    "or allow more tries (error_retries)"
                )
            self._in_flight.pop(flight.request_id, None)
            self._abandoned.add(flight.request_id)
            again.append(_InFlight(self._next_id(), flight.turns, flight.weights, None, flight.tries + 1))
            log.warning("request %s (%d turns) sent again as %s: %s", flight.request_id, len(flight.turns),
                        again[-1].request_id, why)  # fmt: skip
        self.resent += len(again)
        self._submit(again)

    # -- receiving ---------------------------------------------------------------------------------

    def _collect(self) -> list[TurnOutcome]:
        if not self._in_flight and not self._abandoned:
            return []
        # Found by listing, never by opening names that may not exist yet (protocol.spool says why).
        listed = set(os.listdir(self.spool.results))
        late = [i for i in self._abandoned if name_for_id(i) in listed]
        for request_id in late:
            self.spool.consume_result(request_id)
            self._abandoned.discard(request_id)
        arrived = [i for i in self._in_flight if name_for_id(i) in listed]
        if not arrived:
            return []
        outcomes, failed = [], []
        for request_id, result in self.spool.read_results(arrived, {"results": listed}).items():
            flight = self._in_flight.pop(request_id)
            if result.ok or result.error.code is not ErrorCode.BAD_RESULT:
                self.spool.consume_result(request_id)  # a bad_result's file stays for an operator
            if result.ok:
                outcomes += self._outcomes(flight, result)
            elif result.error.code.transient:
                failed.append((flight, f"{result.error.code.value}: {result.error.message}"))
            else:
                worker = f" by worker {result.worker_id}" if result.worker_id else ""
                raise RolloutFailed(
                    f"turns {_keys(flight.turns)} (request {request_id}) were refused{worker}: "
                    f"{result.error.code.value}: {result.error.message}. This error is permanent: sent again "
                    "unchanged, they fail again; change what the message names"
                )
        for flight, why in failed:
            self._send_again([flight], why)
        self._keys.difference_update(outcome.key for outcome in outcomes)
        return outcomes

    @staticmethod
    def _outcomes(flight: _InFlight, result: Result) -> list[TurnOutcome]:
        shape = [len(samples) for samples in result.token_ids]
        if shape != [1] * len(flight.turns) or len(result.logprobs) != len(flight.turns):
            raise RolloutFailed(
                f"worker {result.worker_id} answered request {flight.request_id} with {shape} samples per prompt "
                f"(and {len(result.logprobs)} logprob lists) for {len(flight.turns)} prompts of one sample each: "
                "it does not keep the spool's result contract"
            )
        return [
            TurnOutcome(
                key=turn.key,
                token_ids=list(result.token_ids[i][0]),
                logprobs=list(result.logprobs[i][0]),
                finish_reason=result.finish_reasons[i][0],
                text=result.texts[i][0],
                worker_id=result.worker_id,
                weights_content_id=result.weights_content_id,
                cached_tokens=result.prompt_cached_tokens[i] if len(result.prompt_cached_tokens) > i else None,
                engine_s=result.timings.generate_s,
            )
            for i, turn in enumerate(flight.turns)
        ]

    # -- workers -----------------------------------------------------------------------------------

    def _live_workers(self, now: float) -> list[str]:
        if now >= self._next_check:
            self._check_workers(now)
        return self._live

    def _check_workers(self, now: float) -> None:
        """Refresh the live workers; send again what a dead worker holds; raise when no worker
        has lived for the client's grace while turns wait."""
        self._next_check = now + CHECK_S
        self._live = sorted(status.worker_id for status in self.spool.live_workers())
        if self._absence.too_long(bool(self._live) or not self._keys, now):  # nothing waiting: no absence
            raise RolloutUnavailable(
                f"no live rollout worker serves {self.spool.root} (no fresh heartbeat in {self.spool.workers} for "
                f"{self.client.no_worker_grace_s:.0f} s); {len(self._keys)} turns wait. Start one with "
                f"`rollout-svc serve --spool {self.spool.root}`"
            )
        if not self._in_flight:
            return
        live = set(self._live)
        dead = []
        for entry in self.spool.entries("claimed"):
            original, worker_id = split_claimed_name(entry.name)
            request_id = original.removesuffix(".json")
            if request_id in self._in_flight and worker_id not in live:
                dead.append((self._in_flight[request_id], worker_id))
        for flight, worker_id in dead:
            self._send_again([flight], f"its worker {worker_id} died holding it (no live heartbeat)")

    def _results_waker(self) -> Waker:
        # Started once and kept: a watch costs a thread start, too much for every poll.
        if self._waker is None:
            self._waker = Waker([self.spool.results], poll=self.client.poll).__enter__()
        return self._waker


def _keys(turns: list[Turn], limit: int = 5) -> str:
    keys = ", ".join(turn.key for turn in turns[:limit])
    return keys + (f" and {len(turns) - limit} more" if len(turns) > limit else "")
