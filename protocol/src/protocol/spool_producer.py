"""The producer's side of the spool: publish requests durably, find and read their results,
consume them, and locate every file of a request id."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from . import fsio
from .messages import ErrorCode, MessageError, Request, Result, decode_result, encode_pretty, validate
from .spool_entries import name_for_id, split_claimed_name
from .spool_layout import SpoolError, SpoolLayout


class RequestExists(SpoolError):
    """A request with this id is already in the spool."""


MAX_RESULT_BYTES = 2**30  # a result file larger than this is no worker's (they cap what a request asks)


def _read(path: Path) -> bytes | None:
    """The content of `path`, or None when it is not there. Never blocks: a FIFO, a device, a
    symlink or a file past MAX_RESULT_BYTES raises (fsio.read_regular_file)."""
    try:
        return fsio.read_regular_file(path, MAX_RESULT_BYTES)
    except FileNotFoundError:
        return None


def _read_listed(path: Path, listed: set[str]) -> bytes | None:
    """The content of `path` if a listing of its directory showed it and it is still there."""
    return _read(path) if path.name in listed else None


def _unusable(request_id: str, where: str, why: str) -> Result:
    """The error result a producer gets for a result file it cannot use; the file stays."""
    return Result.failure(
        request_id,
        ErrorCode.BAD_RESULT,
        f"{where} cannot be used as the result of {request_id}: {why}. No worker writes such a file: "
        f"look at it, remove it, then `spoolctl requeue` the request (or submit it under a new id)",
        finished_at=time.time(),
    )


def _result_of(request_id: str, where: str, read) -> Result | None:
    """The result `read()` returns the bytes of (None when there is none), or a bad_result
    error naming `where` when those bytes cannot be had or decoded."""
    try:
        data = read()
    except fsio.NotRegularFile as exc:
        return _unusable(request_id, where, exc.strerror)
    except ValueError:
        return _unusable(request_id, where, f"it is larger than {MAX_RESULT_BYTES} bytes")
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return _unusable(request_id, where, "it is a symlink, not a regular file")
        if exc.errno in (errno.EACCES, errno.EPERM):
            return _unusable(request_id, where, f"this process may not read it ({exc.strerror})")
        raise
    if data is None:
        return None
    try:
        return decode_result(data)
    except MessageError as exc:
        return _unusable(request_id, where, exc.message)


def _refuse_repeated(requests: list[Request]) -> None:
    ids = [r.request_id for r in requests]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise RequestExists(f"request ids {repeated} appear more than once in this batch")


class ProducerSide(SpoolLayout):
    """Spool methods for producers (the trainer, eval jobs, spoolctl)."""

    def submit(self, request: Request) -> Path:
        """Durably publish one request. Raises RequestExists if its id is already in use."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: list[Request]) -> list[Path]:
        """Publish several requests with one directory fsync (group commit).

        Every request is validated first (raises MessageError) and every id checked (raises
        RequestExists), so a bad batch publishes nothing."""
        _refuse_repeated(requests)
        listing = self.listing()  # once per batch
        for request in requests:
            validate(request)
            found = self.locate(request.request_id, listing=listing)
            if found:
                raise RequestExists(
                    f"request id {request.request_id!r} is already used in {self.root} "
                    f"({', '.join(str(p) for p in found)}); pick a new id"
                )
        return self._publish(requests)

    def submit_missing(self, requests: list[Request]) -> list[Request]:
        """Publish, with one directory fsync, those of `requests` whose id the spool holds in no
        state, and return them: a producer sending a call again (a relaunch) sends only what the
        spool lost. One listing of each directory serves the check and the submit. Raises as
        `submit_many` does for a bad request, a repeated id or one submitted concurrently."""
        _refuse_repeated(requests)
        listing = self.listing()
        claimed = {split_claimed_name(c)[0] for c in listing["claimed"]}
        missing = [r for r in requests if not self.locate(r.request_id, claimed, listing=listing)]
        for request in missing:
            validate(request)
        if missing:
            self._publish(missing)
        return missing

    def _publish(self, requests: list[Request]) -> list[Path]:
        """Write each request in tmp/ and link it into requests/ (never replacing), then fsync
        requests/ once. The ids were checked free; one taken since raises RequestExists."""
        scratch_paths = []
        try:
            for request in requests:
                scratch = self.scratch_path(request.request_id)
                fsio.write_synced(scratch, encode_pretty(request))
                scratch_paths.append(scratch)
            finals = []
            for request, scratch in zip(requests, scratch_paths, strict=False):
                final = self.request_path(request.request_id)
                if not fsio.link_no_replace(scratch, final):
                    raise RequestExists(f"request id {request.request_id!r} was submitted concurrently")
                finals.append(final)
        finally:
            for scratch in scratch_paths:  # link_no_replace removed those it reached
                if os.path.lexists(scratch):
                    os.unlink(scratch)
            fsio.fsync_dir(self.requests)
        return finals

    def read_result(self, request_id: str) -> Result | None:
        """The result for `request_id`, from results/ or, once consumed, from done/."""
        return self.read_results([request_id]).get(request_id)

    def read_results(self, request_ids: list[str], listing: dict[str, set[str]] | None = None) -> dict[str, Result]:
        """The results there are for `request_ids`, by id, from results/ or, once consumed,
        from done/. results/ is listed once (or `listing["results"]` is used) and only listed
        names are opened; done/ is never listed (see protocol.spool's docstring). A result file
        that is not a regular file, is too large or does not decode is that id's `bad_result`
        error, the file left where it is; nothing here blocks or raises for a file's content."""
        found: dict[str, Result] = {}
        listed = listing["results"] if listing is not None else set(os.listdir(self.results))
        for request_id in request_ids:
            path = self.result_path(request_id)
            result = _result_of(request_id, f"results/{path.name}", lambda p=path: _read_listed(p, listed))
            if result is None:  # consumed, before or since the listing
                consumed = self.consumed_result_path(request_id)
                result = _result_of(request_id, f"done/{consumed.name}", lambda p=consumed: _read(p))
            if result is not None:
                found[request_id] = result
        return found

    def consume_result(self, request_id: str) -> None:
        """Move a read result out of results/ into done/, where pruning will find it. (A
        `bad_result` one a producer leaves in results/, for an operator to see.)"""
        try:
            os.rename(self.result_path(request_id), self.consumed_result_path(request_id))
        except FileNotFoundError:
            pass

    def has_result(self, request_id: str) -> bool:
        """Whether results/ or done/ holds a result for `request_id`. Looked up by name: a worker
        asks for every request it claims, and a listing each time would cost it O(results/).
        A host's negative cache can only make this say no wrongly; then the request runs once
        more, and its publish still keeps the first result: link() asks the server, and a
        consumed result in done/ is checked as protocol.spool's docstring says of done/."""
        return os.path.lexists(self.result_path(request_id)) or os.path.lexists(self.consumed_result_path(request_id))

    def listing(self, states: tuple[str, ...] = ("requests", "claimed", "results", "bad")) -> dict[str, set[str]]:
        """The names in each of `states`, one listing each."""
        return {state: set(os.listdir(self.root / state)) for state in states}

    def locate(
        self, request_id: str, claimed_names: set[str] | None = None, *, listing: dict[str, set[str]] | None = None
    ) -> list[Path]:
        """Every file of this request id, in any state: found in listings, but in done/ (never
        listed) by name. `listing` (from `listing()`) saves listings when many ids are located
        at once; `claimed_names` (original names of the entries in claimed/) too."""
        listing = listing or self.listing()
        name = name_for_id(request_id)
        candidates = [
            self.request_path(request_id),
            self.result_path(request_id),
            self.archived_request_path(request_id),
            self.consumed_result_path(request_id),
            self.bad_path(name),
        ]
        found = [
            p for p in candidates if (p.name in listing[p.parent.name] if p.parent != self.done else os.path.lexists(p))
        ]
        if claimed_names is None or name in claimed_names:
            found += [self.claimed / c for c in sorted(listing["claimed"]) if split_claimed_name(c)[0] == name]
        return found
