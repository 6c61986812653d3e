"""The trainer's side of the spool (rank 0 only): request samples, get token ids and logprobs,
from the workers serving `rollout.spool`, or from the one the run spawns (spawned_worker).

A sampling call is fanned out: its prompts are split into one request per live worker (their
status files say how many serve the spool; `rollout.fan_out` fixes the number), at most one per
prompt, submitted together and gathered. A worker that dies holding one costs a lease: its claim
goes back to requests/ and another worker serves it. `submit` returns a Ticket, `collect` waits
for it, so requests can stay in flight while the trainer works (sampling.StepSampler).

Request ids are deterministic: run, tag, step, attempt, part, and a digest of everything the
request asks (weights and their content id, prompts, seed, sampling settings). The same call
made again (a relaunch redoing a step) names the same requests, so `submit` and `restore` send
only those the spool has never seen and use the results already there: nothing is sent twice.

Error results. A failed request is sent again, asking exactly the same (same seed: the run's
samples do not depend on the failure), under the next id of its chain `<id>-r1`, `<id>-r2`...:
- transient errors (ErrorCode.transient: the engine crashed, ran out of memory, lost its
  process) at most `rollout.error_retries` times per request and launch, then the call stops
  (RolloutUnavailable, exit 69: relaunch);
- permanent errors (a bad request, weights refused) stop the call at once (RolloutFailed, exit 2),
  naming the request, the error and what to change; so does `bad_result`, a file in results/ that
  is no result (a FIFO, a symlink, junk), which the spool client reports naming the file;
- an error result of a request an earlier launch sent is always sent again and does not count:
  its cause may be gone (the engine restarted, the worker's options fixed), so a relaunch never
  stops on an old result. The chain ids are deterministic, so a relaunch walks past the errors
  already in the spool and uses or awaits the newest try instead of sending another.

No live worker at all is an error within seconds, never a hang; so is a dead or frozen spawned
worker. A call that is not answered within `rollout.timeout_s` is an error naming each request
and where it stands (queued, claimed by whom, done).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import replace

import msgspec

from protocol.client import NoLiveWorker, ResultTimeout, SpoolClient
from protocol.messages import ErrorCode, Request, Result
from protocol.rows import prompt_fields

from ..config import Config
from ..rollout_types import Group, RolloutFailed, RolloutUnavailable, Sample, Ticket, WeightsRef, split_sizes
from .spawned_worker import SpawnedWorker
from .waiting import WaitNotes

log = logging.getLogger(__name__)


class RolloutService:
    def __init__(self, cfg: Config, *, world_size: int = 1, cuda_devices: int | None = None):
        """With `rollout.spawn`, spawns this run's worker (spawned_worker.SpawnedWorker);
        `world_size`, `cuda_devices`: the training ranks and the GPUs this process sees."""
        self.cfg = cfg
        self.sent: set[str] = set()  # ids this launch submitted: only their failures are this launch's
        # Each submitted or restored ticket's requests, by its request ids, until collected: built once
        # (their fields' JSON and digests), then sent, awaited and sent again from here.
        self.built: dict[tuple[str, ...], list[Request]] = {}
        self.client = SpoolClient(cfg.spool_dir, no_worker_grace_s=cfg.rollout.no_worker_grace_s)
        self.worker_id = f"{_id_part(cfg.run_dir.name[:40])}-rollout"  # the spawned worker's
        self.worker: SpawnedWorker | None = None
        if cfg.rollout.spawn:
            if cuda_devices is None:
                import torch

                cuda_devices = torch.cuda.device_count()
            self.worker = SpawnedWorker(
                cfg, self.client.spool, self.worker_id, world_size=world_size, cuda_devices=cuda_devices
            )

    def close(self) -> None:
        """Stop the spawned worker, if any. Idempotent."""
        if self.worker is not None:
            self.worker.close()
        self.client.close()

    def turn_batcher(self, weights: WeightsRef, temperature: float | None = None):
        """A TurnBatcher on this service's spool, for episodes' turns (trainer_svc.envs.sampler),
        sampling at `temperature` (None: rollout.temperature; an eval asks its own)."""
        from .turn_batcher import TurnBatcher

        r = self.cfg.rollout
        return TurnBatcher(
            self.client,
            weights_dir=weights.dir,
            weights_content_id=weights.content_id,
            max_tokens=r.max_tokens,
            temperature=r.temperature if temperature is None else temperature,
            top_p=r.top_p,
            stop=[],
            tag=f"{_id_part(self.cfg.run_dir.name[:40])}-turn",
            error_retries=r.error_retries,
        )

    def _check_worker(self) -> None:
        if self.worker is not None:
            self.worker.check()

    def submit(self, call: Ticket) -> Ticket:
        """Send `call`, fanned out over the live workers; returns at once, with the requests that
        carry it. Requests the spool already holds are not sent again."""
        parts = split_sizes(len(call.prompts), self.cfg.rollout.fan_out or len(self.client.spool.live_workers()))
        requests = self._requests(replace(call, parts=parts))
        self._send(requests)
        ticket = replace(call, parts=parts, request_ids=tuple(r.request_id for r in requests))
        self.built[ticket.request_ids] = requests
        return ticket

    def restore(self, ticket: Ticket) -> None:
        """Take over a call a previous launch made: its results already in the spool are used, its
        requests still queued or claimed are awaited, and only those the spool lost are sent (under
        the ticket's own ids, which `collect` waits for)."""
        requests = [
            msgspec.structs.replace(r, request_id=i)
            for r, i in zip(self._requests(ticket), ticket.request_ids, strict=True)
        ]
        self.built[ticket.request_ids] = requests
        self._send(requests)

    def collect(self, ticket: Ticket) -> list[Group]:
        """The groups of a submitted call, in prompt order, once every request has its result. A
        failed request is sent again or stops the call, as the module docstring says."""
        # Built when it was submitted or restored; a ticket of the same ids collected before it (the same
        # call made twice, in flight together) took that entry, and the same requests are built again.
        built = self.built.pop(ticket.request_ids, None) or self._requests(ticket)
        requests = dict(zip(ticket.request_ids, built, strict=True))
        awaited = {i: i for i in ticket.request_ids}  # the ticket's id -> the try of it awaited now
        tries = dict.fromkeys(ticket.request_ids, 0)  # position in the chain of the try awaited
        resent = dict.fromkeys(ticket.request_ids, 0)  # tries this launch sent after an error of its own
        results: dict[str, Result] = {}
        while len(results) < len(ticket.request_ids):
            pending = [i for i in ticket.request_ids if i not in results]
            found = self._wait(ticket, [awaited[i] for i in pending])
            again = []
            for original in pending:
                result = found[awaited[original]]
                if result.ok:
                    results[original] = result
                    continue
                if awaited[original] in self.sent:  # a failure of this launch's own request
                    self._check_retry(awaited[original], result, tries[original], resent[original])
                    resent[original] += 1
                else:
                    log.warning(
                        "%s, sent by an earlier launch, failed (%s: %s); sending it again",
                        awaited[original],
                        result.error.code.value,
                        result.error.message,
                    )
                tries[original] += 1
                awaited[original] = resend_id(original, tries[original])
                again.append(msgspec.structs.replace(requests[original], request_id=awaited[original]))
            self._send(again)
        for original, last in tries.items():  # answered: forget them, or a long run's record grows without end
            self.sent.difference_update([original, *(resend_id(original, k) for k in range(1, last + 1))])
        return [g for i in ticket.request_ids for g in to_groups(results[i], ticket.weights_step)]

    def _wait(self, ticket: Ticket, request_ids: list[str]) -> dict[str, Result]:
        try:
            worker_log = self.worker.log_path if self.worker is not None else None
            notes = WaitNotes(f"step {ticket.step}'s rollouts ({ticket.tag})", self.client.spool, worker_log)
            return self.client.wait(
                request_ids, timeout_s=self.cfg.rollout.timeout_s, on_poll=lambda: (self._check_worker(), notes())
            )
        except ResultTimeout:
            raise RolloutUnavailable(
                f"step {ticket.step} ({ticket.tag}, attempt {ticket.attempt}) has no complete answer after "
                f"{self.cfg.rollout.timeout_s:.0f} s (rollout.timeout_s): "
                f"{self.client.describe(request_ids)}. "
                f"`spoolctl stats -s {self.cfg.spool_dir}` shows what the workers do"
            ) from None
        except NoLiveWorker as exc:
            self._check_worker()  # a dead spawned worker is the better explanation
            raise RolloutUnavailable(str(exc)) from None

    def _check_retry(self, request_id: str, result: Result, tries: int, resent: int) -> None:
        """Raise unless this launch may send its failed request `request_id` again."""
        error = result.error
        worker = f" (worker {result.worker_id})" if result.worker_id else ""
        if not error.code.transient:
            options = "--allowed-root or --max-model-len"
            if error.code is ErrorCode.REQUEST_TOO_LARGE:  # the worker's limits: the message names the one hit
                options = "the limit the message names (--max-samples, --max-prompts, --max-request-tokens, "
                options += "--max-result-bytes of rollout-svc serve)"
            raise RolloutFailed(
                f"rollout request {request_id} was refused{worker}: {error.code.value}: {error.message}. "
                "This error is permanent: sent again unchanged, the request fails again. Change what the message "
                f"names (the [rollout] or [model] settings, the weights, or the worker's options such as {options}), "
                "then relaunch: the relaunch sends it again under a fresh id"
            )
        if resent >= self.cfg.rollout.error_retries:
            where = f"; see {self.worker.log_path}" if self.worker is not None else ""
            raise RolloutUnavailable(
                f"rollout request {request_id} failed{worker}: {error.code.value}: {error.message}. It failed "
                f"{tries + 1} times, {resent + 1} of them in this launch, which sends a failed request again at most "
                f"rollout.error_retries = {self.cfg.rollout.error_retries} times{where}. Relaunch to try again "
                "(the relaunch sends it again under a fresh id), or raise rollout.error_retries"
            )

    def _requests(self, ticket: Ticket) -> list[Request]:
        r = self.cfg.rollout
        asked = {
            "weights_dir": ticket.weights.dir,
            "weights_content_id": ticket.weights.content_id,
            "n_samples_per_prompt": ticket.n or r.samples_per_prompt,
            "max_tokens": r.max_tokens,
            "temperature": r.temperature if ticket.temperature is None else ticket.temperature,
            "top_p": r.top_p,
            "tag": ticket.tag,
        }
        requests, start = [], 0
        for part, size in enumerate(ticket.parts):
            prompts = list(ticket.prompts[start : start + size])
            fields = {**asked, **prompt_fields(prompts), "seed": ticket.seed + part}
            start += size
            digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
            run, tag = _id_part(self.cfg.run_dir.name[:40]), _id_part(ticket.tag[:12])
            name = f"{run}-{tag}-s{ticket.step:08d}-a{ticket.attempt}-p{part}-{digest}"
            requests.append(msgspec.convert({"request_id": name, **fields}, Request))
        if not requests:
            return requests
        # One call id on every part, so that workers leave the other parts to their idle peers; from
        # the parts' ids, so the same call made again names the same call.
        call_digest = hashlib.sha256(" ".join(r.request_id for r in requests).encode()).hexdigest()[:12]
        call_id = f"{run}-{tag}-s{ticket.step:08d}-a{ticket.attempt}-{call_digest}"
        return [msgspec.structs.replace(r, call_id=call_id) for r in requests]

    def _send(self, requests: list[Request]) -> None:
        """Submit, in one batch, the requests the spool does not hold in any state (one listing)."""
        missing = self.client.submit_missing(requests)
        self.sent.update(r.request_id for r in missing)
        if len(missing) < len(requests):
            log.info(
                "%d of %d requests were already in the spool; using them", len(requests) - len(missing), len(requests)
            )


def resend_id(request_id: str, tries: int) -> str:
    """The id under which a failed request is sent for the `tries`-th time again."""
    return f"{request_id}-r{tries}"


def to_groups(result: Result, weights_step: int = 0) -> list[Group]:
    groups = []
    for prompt_ids, ids, logprobs, texts, reasons in zip(
        result.prompt_token_ids, result.token_ids, result.logprobs, result.texts, result.finish_reasons, strict=True
    ):
        samples = [Sample(list(i), list(lp), t, f) for i, lp, t, f in zip(ids, logprobs, texts, reasons, strict=True)]
        groups.append(Group(list(prompt_ids), samples, weights_step))
    return groups


def _id_part(text: str) -> str:
    """`text` as part of a request or worker id, which allow letters, digits and . _ - only and
    must start with a letter or digit: any other character (a run directory named "run 1,b")
    becomes _."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", text)
    return safe if safe[:1].isalnum() else f"x{safe}"
