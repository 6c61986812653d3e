"""The producer's side of the spool: publish requests durably, find and read their results,
consume them, and locate every file of a request id."""

from __future__ import annotations

import os
from pathlib import Path

from . import fsio
from .messages import Request, Result, decode_result, encode_pretty, validate
from .spool_entries import name_for_id, split_claimed_name
from .spool_layout import SpoolError, SpoolLayout


class RequestExists(SpoolError):
    """A request with this id is already in the spool."""


def _read(path: Path) -> bytes | None:
    """The content of `path`, or None when it is not there."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _read_listed(path: Path, listed: set[str]) -> bytes | None:
    """The content of `path` if a listing of its directory showed it and it is still there."""
    return _read(path) if path.name in listed else None


class ProducerSide(SpoolLayout):
    """Spool methods for producers (the trainer, eval jobs, spoolctl)."""

    def submit(self, request: Request) -> Path:
        """Durably publish one request. Raises RequestExists if its id is already in use."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: list[Request]) -> list[Path]:
        """Publish several requests with one directory fsync (group commit).

        Every request is validated first (raises MessageError) and every id checked (raises
        RequestExists), so a bad batch publishes nothing."""
        ids = [r.request_id for r in requests]
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise RequestExists(f"request ids {repeated} appear more than once in this batch")
        listing = self.listing()  # once per batch
        for request in requests:
            validate(request)
            found = self.locate(request.request_id, listing=listing)
            if found:
                raise RequestExists(
                    f"request id {request.request_id!r} is already used in {self.root} "
                    f"({', '.join(str(p) for p in found)}); pick a new id"
                )
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
        names are opened; done/ is never listed (see protocol.spool's docstring)."""
        found: dict[str, Result] = {}
        listed = listing["results"] if listing is not None else set(os.listdir(self.results))
        for request_id in request_ids:
            data = _read_listed(self.result_path(request_id), listed)
            if data is None:  # consumed, before or since the listing
                data = _read(self.consumed_result_path(request_id))
            if data is not None:
                found[request_id] = decode_result(data)
        return found

    def consume_result(self, request_id: str) -> None:
        """Move a read result out of results/ into done/, where pruning will find it."""
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
