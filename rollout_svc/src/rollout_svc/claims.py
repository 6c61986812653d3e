"""A worker's claims outside the engine call: taking one, giving back those of an earlier life, and
settling them when a file, the disk or the heartbeat fails.

Guarantees:
- A claim is spool.claim, tried again on ESTALE or EIO; a retried rename that finds the file gone
  because its first try moved it (over NFS the reply can be lost) is ours when the claim under
  our id exists.
- Settling archives a claim whose result is published and gives the others back to requests/;
  a claim that cannot be moved stays in claimed/ (this worker's next life gives it back, or others
  once its lease runs out). Every claim given back is counted as abandoned in the status file.
- One file's failure sets its claims aside: settled, and skipped for a while (skipped.py) so the
  worker serves the others. A full disk (ENOSPC, EDQUOT, EFBIG) or a spool that cannot be read
  settles every claim in hand and answers CANNOT_WRITE (74), its log naming the spool; a lost
  heartbeat answers INTERNAL_ERROR (1) and touches no claim (others serve them once the lease runs
  out), unless the heartbeat failed for a full disk.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from protocol import exit_codes
from protocol.spool import Claim, Spool, split_claimed_name

from .errors import TRANSIENT, is_full_disk, retrying
from .skipped import Skipped
from .status import Heartbeat

log = logging.getLogger(__name__)

EXIT_HEARTBEAT_LOST = exit_codes.INTERNAL_ERROR  # systemd restarts it; others serve its claims
EXIT_CANNOT_WRITE = exit_codes.CANNOT_WRITE  # a full disk, or a spool that cannot be read: claims given back


@dataclass
class Claims:
    """The claims of the worker `worker_id`: taken, given back and settled in `spool`."""

    spool: Spool
    worker_id: str
    heartbeat: Heartbeat
    skipped: Skipped

    def claim(self, entry) -> Claim | None:
        """spool.claim, tried again on ESTALE or EIO. A retried rename may find the file gone
        because its first try moved it (over NFS the reply can be lost): then the claim under
        our id is ours."""
        transient: list[OSError] = []

        def attempt() -> Claim | None:
            try:
                return self.spool.claim(entry, self.worker_id)
            except OSError as exc:
                if exc.errno in TRANSIENT:
                    transient.append(exc)
                raise

        claim = retrying(attempt, f"claiming {entry.path}")
        target = self.spool.claim_path(entry.name, self.worker_id)
        if claim is None and transient and os.path.lexists(target):
            return Claim(entry.name, target, self.worker_id, entry.mtime)
        return claim

    def recover_own(self) -> None:
        for entry in self.spool.entries("claimed"):
            original, worker_id = split_claimed_name(entry.name)
            if worker_id == self.worker_id:
                try:
                    self.spool.release(Claim(original, entry.path, worker_id, entry.mtime))
                except OSError as exc:  # one file: the others still go back, and the worker serves
                    log.error("cannot give back claimed/%s of an earlier life: %s", entry.name, exc)

    def cannot_write(self, exc: OSError, claims: list[Claim]) -> int:
        """A spool write failed for a full disk (ENOSPC, EDQUOT, EFBIG), or the spool cannot be
        read. Claims whose result is published are archived, the others go back to requests/ for
        a worker that can write, and the worker exits: serving on would only repeat the failure."""
        given_back = self.settle(claims)
        if is_full_disk(exc):
            what = "cannot write to the spool %s: %s; gave back %d requests. Free space on its filesystem, then restart"
        else:
            what = "cannot use the spool %s: %s; gave back %d requests. Check its filesystem, then restart"
        log.error(what, self.spool.root, exc, given_back)
        return EXIT_CANNOT_WRITE

    def settle(self, claims: list[Claim]) -> int:
        """Archive the claims among `claims` whose result is published and give the others back
        to requests/; returns how many were given back. A claim that cannot be moved stays in
        claimed/: this worker's next life gives it back, or others once its lease runs out."""
        given_back = 0
        for claim in claims:
            try:
                if not self.spool.holds(claim):
                    continue
                published = self.spool.read_result(claim.request_id) if claim.request_id is not None else None
                if published is not None:
                    self.spool.finish(claim, rejected=not published.ok and published.error.code.rejects_input)
                else:
                    self.spool.release(claim)
                    given_back += 1
            except OSError as exc:
                log.error("claim %s cannot be archived or given back: %s", claim.path, exc)
        self.heartbeat.count(requests_abandoned=given_back)
        return given_back

    def set_aside(self, claims: list[Claim], exc: OSError, what: str) -> None:
        """One file's failure (not a full disk): settle `claims` and skip those given back for a
        while, so that the worker serves the others and does not try them again at every scan."""
        self.settle(claims)
        for claim in claims:
            path = self.spool.requests / claim.name
            if os.path.lexists(path):
                self.skipped.skip(claim.name, path, exc, f"{what} requests/{claim.name}")

    def heartbeat_lost(self, claims: list[Claim]) -> int:
        """The status file could not be written for half a lease. On a full disk the claims go
        back at once and the worker exits CANNOT_WRITE; otherwise it exits INTERNAL_ERROR
        without touching them (others serve them once the lease runs out)."""
        failure = self.heartbeat.failure
        if failure is not None and is_full_disk(failure):
            return self.cannot_write(failure, claims)
        if claims:
            log.error("heartbeat lost before publishing %d results; abandoning them", len(claims))
            self.heartbeat.count(requests_abandoned=len(claims))
        else:
            log.error("heartbeat lost; exiting without publishing so others can take over")
        return EXIT_HEARTBEAT_LOST
