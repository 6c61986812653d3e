"""The spool: a directory through which producers and rollout workers exchange messages.

Layout (all on one filesystem):

    tmp/       scratch files being written; never read by consumers
    requests/  <request_id>.json, ready for any worker
    claimed/   <request_id>@<worker_id>.json, a request being served
    results/   <request_id>.json, exactly one per request, success or error
    done/      <request_id>.request.json (served requests) and <request_id>.result.json
               (results a producer has consumed); pruned by age
    bad/       request files that could not be accepted, kept for inspection (<name>, or
               <name>.<n> when that is taken), and <name>.error.txt: why, for names with no id
    workers/   <worker_id>.json, one status file per worker; its mtime is the heartbeat

Each kind of file name is spelled out once, in the path methods of Spool (`request_path`,
`claim_path`, `result_path`, `archived_request_path`, `consumed_result_path`, `bad_path`,
`bad_note_path`, `status_path`, `scratch_path`); the rest of this module, and code outside it,
goes through them.

Guarantees (each has a test in tests/unit/test_spool.py):

1. No reader sees a partial file in requests/, results/ or workers/: files are written in tmp/
   and linked or renamed into place; requests and results are fsynced, and so is their directory.
2. Each request that reaches requests/ gets exactly one result file. Claims are renames, so one
   worker wins each request; a dead worker's claim goes back to requests/ (at-least-once
   execution) and results are published with link(), which never replaces: the first result wins.
3. A request file that cannot be accepted gets an error result (when its name is a valid id) and
   is moved to bad/; nothing raises out of the spool for bad input.
4. A claim whose worker heartbeat has not changed for the worker's lease, as this process saw it
   (leases.py), is put back in requests/.
   Workers check that their claim still exists before they publish.
5. The directory listing is the truth: `pending()` scans, and file events only wake scanners.
6. Every wait that involves this module is bounded (see client.py).

On a network filesystem (NFS, Lustre, CephFS, sshfs) several hosts share the spool, and three
local habits fail there:

- A name looked up while absent may stay absent on that host for as long as its negative lookup
  cache holds (NFS: until the directory's attributes are revalidated; FUSE: negative_timeout),
  however long ago another host created it. So names in results/, requests/, claimed/ and bad/
  are found by listing their directory, and opened only once a listing shows them
  (`read_results`, `locate`, the client's wait; `has_result` says why it need not). done/ is
  the exception: it grows without bound between prunes, so it is never listed on a request's
  path; its names are looked up, and a host mostly looks there for what it moved there itself
  (a producer for the results it consumed). On NFS, `lookupcache=positive` closes that gap.
- link() over NFSv3 may report EEXIST for a link it made (a retransmitted request): see
  fsio.link_no_replace, which recognises its own file.
- Hosts' clocks differ, and some filesystems stamp mtimes with the writer's clock: a lease is
  judged by whether the heartbeat changes as this process sees it, on its own clock (leases.py).
"""

from __future__ import annotations

import errno
import functools
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import fsio
from .leases import HeartbeatWatch, Seen
from .messages import (
    ErrorCode,
    MessageError,
    Request,
    Result,
    WorkerStatus,
    decode_request,
    decode_result,
    decode_status,
    encode,
    encode_pretty,
    is_valid_id,
    validate,
)

STATES = ("tmp", "requests", "claimed", "results", "done", "bad", "workers")
MAX_REQUEST_BYTES = 64 * 2**20  # a request larger than this is refused with `too_large`
DEFAULT_LEASE_S = 30.0
_NAME_MAX = 255  # bytes in one file name on Linux filesystems
_JSON = ".json"
_RESULT_SUFFIX = ".result.json"
_REQUEST_SUFFIX = ".request.json"
_NOTE_SUFFIX = ".error.txt"


class SpoolError(RuntimeError):
    """The spool directory is missing, incomplete or unusable; the message says what to do."""


class RequestExists(SpoolError):
    """A request with this id is already in the spool."""


class ClaimLost(RuntimeError):
    """A claim vanished (recovered or requeued by someone else) before the worker read it."""


@dataclass(frozen=True)
class Entry:
    """One directory entry as a scan saw it."""

    name: str
    path: Path
    mtime: float  # when the file was written (renames keep it)
    ctime: float  # when it last moved (renames set it)
    size: int

    @property
    def request_id(self) -> str | None:
        """The id this entry names, or None when its name is not `<valid id>.json`."""
        return id_from_name(self.name)


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


def name_for_id(request_id: str) -> str:
    """`<request_id>.json`: the name of a request in requests/ and of its result in results/."""
    return f"{request_id}{_JSON}"


def id_from_name(name: str) -> str | None:
    """Inverse of name_for_id: the id, or None when `name` is not `<valid id>.json`."""
    if not name.endswith(_JSON):
        return None
    stem = name[: -len(_JSON)]
    return stem if is_valid_id(stem) else None


def claimed_name(name: str, worker_id: str) -> str:
    """The name in claimed/ of the entry `name` of requests/ claimed by `worker_id`."""
    if name.endswith(_JSON):
        return f"{name[: -len(_JSON)]}@{worker_id}{_JSON}"
    return f"{name}@{worker_id}"


def split_claimed_name(claimed: str) -> tuple[str, str]:
    """Inverse of claimed_name: (original name, worker id). Worker ids contain no '@'."""
    suffix = _JSON if claimed.endswith(_JSON) else ""
    base = claimed[: len(claimed) - len(suffix)]
    original, _, worker_id = base.rpartition("@")
    return original + suffix, worker_id


def _scan(directory: Path) -> list[Entry]:
    entries = []
    with os.scandir(directory) as it:
        for d in it:
            try:
                st = d.stat(follow_symlinks=False)
            except FileNotFoundError:  # moved away while we listed
                continue
            entries.append(Entry(d.name, Path(d.path), st.st_mtime, st.st_ctime, st.st_size))
    return entries


def _read(path: Path) -> bytes | None:
    """The content of `path`, or None when it is not there."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _read_listed(path: Path, listed: set[str]) -> bytes | None:
    """The content of `path` if a listing of its directory showed it and it is still there."""
    return _read(path) if path.name in listed else None


class Spool:
    """A spool rooted at one directory. Cheap to construct; holds no open files."""

    def __init__(self, root: str | os.PathLike, *, create: bool = False, clock: Callable[[], float] = time.monotonic):
        """`clock`: this observer's monotonic clock, by which heartbeat ages are judged."""
        self.root = Path(root).absolute()
        self._workers_watch = HeartbeatWatch(clock)  # by status file name
        self._claims_watch = HeartbeatWatch(clock)  # claims without a readable status, by name
        for state in STATES:
            setattr(self, state, self.root / state)
        if create:
            for state in STATES:
                (self.root / state).mkdir(parents=True, exist_ok=True)
        self._check_layout()

    tmp: Path
    requests: Path
    claimed: Path
    results: Path
    done: Path
    bad: Path
    workers: Path

    def _check_layout(self) -> None:
        missing = [s for s in STATES if not (self.root / s).is_dir()]
        if missing:
            raise SpoolError(
                f"{self.root} is not a spool: missing {', '.join(m + '/' for m in missing)}. "
                f"Create it with `spoolctl init {self.root}` (or let `rollout-svc serve` create it)."
            )
        devices = {(self.root / s).stat().st_dev for s in STATES}
        if len(devices) > 1:
            raise SpoolError(
                f"the directories of spool {self.root} are on {len(devices)} filesystems; "
                "renames between them are not atomic. Keep all of them on one filesystem."
            )

    # -- paths: each kind of spool file is named here and nowhere else ---------------------------

    def request_path(self, request_id: str) -> Path:
        """requests/<request_id>.json: a request ready for any worker."""
        return self.requests / name_for_id(request_id)

    def claim_path(self, name: str, worker_id: str) -> Path:
        """claimed/<request_id>@<worker_id>.json: the entry `name` of requests/ once `worker_id`
        claimed it (an entry not named `<...>.json` becomes `<name>@<worker_id>`)."""
        return self.claimed / claimed_name(name, worker_id)

    def result_path(self, request_id: str) -> Path:
        """results/<request_id>.json: the one result of a request, until a producer consumes it."""
        return self.results / name_for_id(request_id)

    def archived_request_path(self, request_id: str) -> Path:
        """done/<request_id>.request.json: a served request, kept for audit and replay."""
        return self.done / f"{request_id}{_REQUEST_SUFFIX}"

    def consumed_result_path(self, request_id: str) -> Path:
        """done/<request_id>.result.json: a result once its producer consumed it."""
        return self.done / f"{request_id}{_RESULT_SUFFIX}"

    def bad_path(self, name: str) -> Path:
        """bad/<name>: an entry of requests/ that could not be accepted, under its own name."""
        return self.bad / name

    def bad_note_path(self, name: str) -> Path:
        """bad/<name>.error.txt: why the entry `name` (which has no valid id, hence no result)
        was refused; long names are cut."""
        return self.bad / f"{name[:200]}{_NOTE_SUFFIX}"

    def status_path(self, worker_id: str) -> Path:
        """workers/<worker_id>.json: a worker's status; its mtime is the heartbeat."""
        return self.workers / f"{worker_id}{_JSON}"

    def scratch_path(self, stem: str) -> Path:
        """tmp/<stem>.<pid>.<random>.tmp: a scratch file no other writer will pick."""
        return self.tmp / fsio.scratch_name(stem)

    def _free_bad_path(self, name: str) -> Path:
        """bad/<name>, or bad/<name>.<n> with the first n not taken: earlier rejects are kept."""
        target, n = self.bad_path(name), 1
        while os.path.lexists(target):
            target, n = self.bad_path(f"{name}.{n}"), n + 1
        return target

    # -- producers -----------------------------------------------------------------------------

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
        names are opened; done/ is never listed (see the module docstring)."""
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
        consumed result in done/ is checked as the module docstring says of done/."""
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

    # -- workers -------------------------------------------------------------------------------

    def pending(self) -> list[Entry]:
        """Entries in requests/, oldest first. Hidden files (editors' swap files) are skipped."""
        entries = [e for e in _scan(self.requests) if not e.name.startswith(".")]
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
        # so there is no result to write: a note in bad/ says why.
        try:
            os.rename(entry.path, self._free_bad_path(entry.name))
        except FileNotFoundError:
            return
        self._note_in_bad(
            entry.name,
            ErrorCode.INVALID_REQUEST,
            f"file name {entry.name!r} is too long; name request files <request_id>.json",
        )

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
            # Compact: results carry [prompt][sample][token] lists; `spoolctl show` pretty-prints.
            fsio.write_synced(scratch, encode(result))
            final = self.result_path(result.request_id)
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

    # -- worker status and leases --------------------------------------------------------------

    def write_status(self, status: WorkerStatus) -> None:
        # Not fsynced: it is rewritten every few seconds and only its freshness matters.
        fsio.publish(self.tmp, self.status_path(status.worker_id), encode_pretty(status), replace=True, durable=False)

    def remove_status(self, worker_id: str) -> None:
        try:
            os.unlink(self.status_path(worker_id))
        except FileNotFoundError:
            pass

    def statuses(self) -> list[tuple[Entry, WorkerStatus | None]]:
        """Every status file with its decoded content (None when unreadable)."""
        out = []
        for entry in _scan(self.workers):
            if not entry.name.endswith(_JSON):
                continue
            try:
                out.append((entry, decode_status(entry.path.read_bytes())))
            except (OSError, MessageError):
                out.append((entry, None))
        return out

    def filesystem_now(self) -> float:
        """Now by the clock that stamps this spool's files (the file server's on NFS and sshfs,
        the writer's on Lustre): the mtime of a file just written in tmp/."""
        probe = self.scratch_path(".clock")
        fsio.write_synced(probe, b"", fsync=False)
        try:
            return os.stat(probe).st_mtime
        finally:
            os.unlink(probe)

    def heartbeats(self) -> list[tuple[Entry, WorkerStatus | None, Seen]]:
        """Every status file, its content (None when unreadable), and what this Spool's observer
        has seen of it (leases.py: ages by change, on this process's clock)."""
        fs_now = functools.cache(self.filesystem_now)  # asked once, and only at a first sight
        out = []
        for entry, status in self.statuses():
            signature = (entry.mtime, entry.size, status.heartbeat_at if status is not None else None)
            seen = self._workers_watch.look(entry.name, signature, lambda e=entry: fs_now() - e.mtime)
            out.append((entry, status, seen))
        self._workers_watch.forget_all_but({entry.name for entry, _, _ in out})
        return out

    def live_workers(self, now: float | None = None) -> list[WorkerStatus]:
        """Workers whose heartbeat changed within their lease, as this observer saw it (a first
        sight counts the heartbeat's age on the filesystem's clock). `now` judges as if the
        wall clock read `now`."""
        ahead = 0.0 if now is None else now - time.time()
        watch = self._workers_watch
        return [s for _, s, seen in self.heartbeats() if s is not None and watch.age(seen, ahead) <= s.lease_s]

    def recover_stale(self, default_lease_s: float = DEFAULT_LEASE_S, now: float | None = None) -> list[str]:
        """Put back in requests/ every claim whose worker is dead; returns their names.

        A worker is dead when its heartbeat (its status file) has not changed for its own
        lease, as this observer saw it, and the observer watched it stand still for at least
        half the lease (leases.py: a first look never takes claims). A claim without a
        readable status file is judged the same way by the claim itself and `default_lease_s`.
        `now` judges as if the wall clock read `now` (the time since passing without change).
        """
        ahead = 0.0 if now is None else now - time.time()
        heartbeats = {s.worker_id: (seen, s.lease_s) for _, s, seen in self.heartbeats() if s is not None}
        fs_now = functools.cache(self.filesystem_now)  # asked once, and only at a first sight
        claims = _scan(self.claimed)
        self._claims_watch.forget_all_but({entry.name for entry in claims})
        recovered = []
        for entry in claims:
            original, worker_id = split_claimed_name(entry.name)
            if worker_id in heartbeats:
                seen, lease = heartbeats[worker_id]
                watch = self._workers_watch
            else:
                age = lambda e=entry: fs_now() - e.ctime  # noqa: E731
                seen, lease = self._claims_watch.look(entry.name, (entry.ctime, entry.mtime), age), default_lease_s
                watch = self._claims_watch
            if not watch.dead(seen, lease, ahead):
                continue
            try:
                os.rename(entry.path, self.requests / original)
            except FileNotFoundError:
                continue  # finished or recovered by someone else meanwhile
            recovered.append(original)
        return recovered

    # -- housekeeping --------------------------------------------------------------------------

    def entries(self, state: str) -> list[Entry]:
        if state not in STATES:
            raise ValueError(f"unknown state {state!r}; one of {', '.join(STATES)}")
        return sorted(_scan(self.root / state), key=lambda e: (e.mtime, e.name))

    def prune(
        self,
        *,
        done_older_than_s: float,
        tmp_older_than_s: float = 3600.0,
        dead_workers_older_than_s: float = 86400.0,
        now: float | None = None,
    ) -> dict[str, int]:
        """Delete done/ entries archived more than `done_older_than_s` ago, tmp/ leftovers
        older than `tmp_older_than_s` (a writer needs well under a second for a scratch file),
        and status files of workers silent for `dead_workers_older_than_s` (killed workers
        leave theirs; a live worker rewrites its own every few seconds)."""
        now = time.time() if now is None else now
        removed = {"done": 0, "tmp": 0, "workers": 0}
        limits = (("done", done_older_than_s), ("tmp", tmp_older_than_s), ("workers", dead_workers_older_than_s))
        for state, age_limit in limits:
            for entry in _scan(self.root / state):
                # ctime: when the entry was moved here (rename keeps mtime, sets ctime); a
                # status file's age is its mtime, the heartbeat.
                age = now - (entry.mtime if state == "workers" else max(entry.ctime, entry.mtime))
                if age > age_limit:
                    try:
                        os.unlink(entry.path)
                        removed[state] += 1
                    except FileNotFoundError:
                        pass
        return removed
