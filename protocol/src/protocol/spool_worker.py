"""The worker's side of the spool: list pending requests, claim one by rename, read and check
it, publish results (the first one wins), and archive, reject or give back the claim."""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from . import fsio
from .messages import ErrorCode, MessageError, Request, Result, decode_request, encode
from .spool_entries import Entry, id_from_name, scan
from .spool_layout import SpoolLayout

MAX_REQUEST_BYTES = 64 * 2**20  # a request larger than this is refused with `too_large`
_NAME_MAX = 255  # bytes in one file name on Linux filesystems


class ClaimLost(RuntimeError):
    """A claim vanished (recovered or requeued by someone else) before the worker read it."""


@dataclass(frozen=True)
class Claim:
    """A request entry this worker moved into claimed/."""

    name: str  # the entry's name in requests/
    path: Path  # its path in claimed/
    worker_id: str
    arrived_at: float  # mtime of the request file: when it was written

    @property
    def request_id(self) -> str | None:
        return id_from_name(self.name)


class WorkerSide(SpoolLayout):
    """Spool methods for rollout workers, from a pending request to its archived claim."""

    def pending(self) -> list[Entry]:
        """Entries in requests/, oldest first. Hidden files (editors' swap files) are skipped."""
        entries = [e for e in scan(self.requests) if not e.name.startswith(".")]
        entries.sort(key=lambda e: (e.mtime, e.name))
        return entries

    def claim(self, entry: Entry, worker_id: str) -> Claim | None:
        """Move `entry` into claimed/ for `worker_id`. None when another worker got it first,
        or when the name is too long to claim (such an entry goes straight to bad/)."""
        target = self.claim_path(entry.name, worker_id)
        if len(os.fsencode(target.name)) > _NAME_MAX:
            self._reject_unclaimable(entry)
            return None
        try:
            os.rename(entry.path, target)
        except FileNotFoundError:
            return None
        return Claim(entry.name, target, worker_id, entry.mtime)

    def _reject_unclaimable(self, entry: Entry) -> None:
        # Only names that are not `<valid id>.json` get here (valid ids are short enough),
        # so there is no result to write: a note in bad/ says why. The note is written first:
        # on a full disk the entry stays in requests/ rather than sit in bad/ unexplained.
        if not os.path.lexists(entry.path):
            return
        self._note_in_bad(
            entry.name,
            ErrorCode.INVALID_REQUEST,
            f"file name {entry.name!r} is too long; name request files <request_id>.json",
        )
        try:
            os.rename(entry.path, self._free_bad_path(entry.name))
        except FileNotFoundError:
            return

    def load(self, claim: Claim, max_bytes: int = MAX_REQUEST_BYTES) -> Request:
        """Read and validate a claimed request. Raises MessageError, never anything else."""
        request_id = claim.request_id
        if request_id is None:
            raise MessageError(
                ErrorCode.INVALID_REQUEST,
                f"file name {claim.name!r} is not <request_id>.json with an id matching "
                "[A-Za-z0-9][A-Za-z0-9._-]{0,127}",
            )
        try:
            st = os.lstat(claim.path)
        except FileNotFoundError:
            raise ClaimLost(f"{claim.name} was taken back before it could be read") from None
        except OSError as exc:
            raise MessageError(
                ErrorCode.UNREADABLE, f"requests/{claim.name} cannot be examined by the worker ({exc.strerror})"
            ) from None
        if not stat.S_ISREG(st.st_mode):
            if stat.S_ISLNK(st.st_mode):
                kind = "a symlink"
            elif stat.S_ISDIR(st.st_mode):
                kind = "a directory"
            else:
                kind = "not a regular file"
            raise MessageError(
                ErrorCode.NOT_A_FILE,
                f"requests/{claim.name} is {kind}; submit a regular file (write it in tmp/, then mv)",
            )
        if st.st_size > max_bytes:
            raise MessageError(
                ErrorCode.TOO_LARGE,
                f"requests/{claim.name} is {st.st_size} bytes, more than the {max_bytes} accepted; "
                "split it into several requests",
            )
        try:
            data = fsio.read_regular_file(claim.path, max_bytes)
        except ValueError:
            raise MessageError(ErrorCode.TOO_LARGE, f"requests/{claim.name} grew past {max_bytes} bytes") from None
        except FileNotFoundError:
            raise ClaimLost(f"{claim.name} was taken back before it could be read") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise MessageError(ErrorCode.NOT_A_FILE, f"requests/{claim.name} is a symlink") from None
            raise MessageError(
                ErrorCode.UNREADABLE,
                f"requests/{claim.name} cannot be read by the worker ({exc.strerror}); "
                "make it readable by the service group (write it with the spool's umask)",
            ) from None
        request = decode_request(data)
        if request.request_id != request_id:
            raise MessageError(
                ErrorCode.ID_MISMATCH,
                f"request_id {request.request_id!r} differs from the file name {claim.name!r}; "
                f"name the file {request.request_id}.json",
            )
        return request

    def holds(self, claim: Claim) -> bool:
        """True while the claim is still ours (recovery has not given it back)."""
        return os.path.lexists(claim.path)

    def publish_results(self, results: list[Result]) -> list[bool]:
        """Durably publish results with one directory fsync. The first result of an id wins:
        returns, per result, whether this call published it."""
        published = []
        for result in results:
            scratch = self.scratch_path(result.request_id)
            final = self.result_path(result.request_id)
            with fsio.naming_final(final):
                # Compact: results carry [prompt][sample][token] lists; `spoolctl show` pretty-prints.
                fsio.write_synced(scratch, encode(result))
                linked = fsio.link_no_replace(scratch, final)
            published.append(linked and not self._superseded_by_consumed(final, result.request_id))
        if any(published):
            fsio.fsync_dir(self.results)
        return published

    def _superseded_by_consumed(self, final: Path, request_id: str) -> bool:
        """A result a producer already consumed (moved to done/) still wins over ours: a late
        duplicate execution must not publish a second result. If the consumed file is the one
        we just linked (consumed in between), ours stands."""
        try:
            consumed = os.stat(self.consumed_result_path(request_id))
        except FileNotFoundError:
            return False
        try:
            ours = os.stat(final)
        except FileNotFoundError:  # ours was consumed already: it is the one in done/
            return False
        if (consumed.st_dev, consumed.st_ino) == (ours.st_dev, ours.st_ino):
            return False
        os.unlink(final)
        return True

    def finish(self, claim: Claim, *, rejected: bool = False) -> None:
        """Archive a served claim in done/, or keep it in bad/ when its error result
        `rejected` it for its content (ErrorCode.rejects_input). Its result must already be
        published."""
        target = self._free_bad_path(claim.name) if rejected else self.archived_request_path(claim.request_id)
        self._move_claim(claim, target)

    def reject(self, claim: Claim, error: MessageError, worker_id: str = "") -> bool:
        """Give a bad request its error result (when it has a valid id) and keep it in bad/.

        Returns whether the error result was published by this call."""
        published = False
        if claim.request_id is not None:
            result = Result.failure(
                claim.request_id, error.code, error.message, worker_id=worker_id, finished_at=time.time()
            )
            published = self.publish_results([result])[0]
        else:
            self._note_in_bad(claim.name, error.code, error.message)
        self._move_claim(claim, self._free_bad_path(claim.name))
        return published

    def _note_in_bad(self, name: str, code: ErrorCode, message: str) -> None:
        """bad/<name>.error.txt: why an entry without a valid id was refused."""
        fsio.publish(self.tmp, self.bad_note_path(name), f"{code.value}: {message}\n".encode(), replace=True)

    def release(self, claim: Claim) -> None:
        """Give a claim back to requests/ unserved (shutdown, or the worker cannot serve it)."""
        self._move_claim(claim, self.requests / claim.name)

    def _move_claim(self, claim: Claim, target: Path) -> None:
        try:
            os.rename(claim.path, target)
        except FileNotFoundError:  # recovered meanwhile; whoever holds it now will finish it
            pass
