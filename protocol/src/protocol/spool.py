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

Each kind of file name is spelled out once, in SpoolLayout's path methods (spool_layout.py).

Guarantees (each has a test in tests/unit/test_spool.py):

1. No reader sees a partial file in requests/, results/ or workers/: files are written in tmp/
   and linked or renamed into place; requests and results are fsynced, and so is their directory.
2. Each request that reaches requests/ gets exactly one result file. Claims are renames, so one
   worker wins each request; a dead worker's claim goes back to requests/ (at-least-once
   execution) and results are published with link(), which never replaces: the first result wins.
3. A request file that cannot be accepted gets an error result (when its name is a valid id) and
   is moved to bad/; nothing raises out of the spool for bad input.
4. A claim whose worker heartbeat has not changed for the worker's lease, as this process saw it
   (leases.py), is put back in requests/. Workers check that their claim still exists before they
   publish.
5. The directory listing is the truth: `pending()` scans, and file events only wake scanners.
6. Every wait that involves this module is bounded (see client.py).
7. No file in the spool blocks a reader or raises out of it: every spool file is read with
   fsio.read_regular_file (no FIFO opened blocking, no final symlink followed, a size cap); a
   status file that does not read is no worker, a result that does not is its id's `bad_result`
   (tests/unit/test_hostile_spool_reads.py, tests/e2e/test_hostile_spool_files.py).

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

This module composes Spool from its parts and re-exports their names:

    spool_entries.py    file names (request id <-> name, claim names) and directory entries
    spool_layout.py     the directories and the path of each kind of file (SpoolLayout)
    spool_producer.py   submit, read and consume results, locate a request id (ProducerSide)
    spool_worker.py     pending, claim, load, publish results, finish, reject (WorkerSide)
    spool_liveness.py   worker status files, heartbeats, recovery of dead workers' claims
    spool_prune.py      pruning done/, tmp/ and dead workers' status files by age
    spool_names.py      which weights the waiting and claimed requests name (for pruning weights)
    spool_filesystem.py the start check: hard links and rename over a file work in the spool
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from .leases import HeartbeatWatch
from .spool_entries import Entry, claimed_name, id_from_name, name_for_id, split_claimed_name
from .spool_layout import STATES, SpoolError
from .spool_liveness import DEFAULT_LEASE_S, Liveness
from .spool_producer import ProducerSide, RequestExists
from .spool_prune import Pruning
from .spool_worker import MAX_REQUEST_BYTES, Claim, ClaimLost, WorkerSide

__all__ = [
    "DEFAULT_LEASE_S",
    "MAX_REQUEST_BYTES",
    "STATES",
    "Claim",
    "ClaimLost",
    "Entry",
    "RequestExists",
    "Spool",
    "SpoolError",
    "claimed_name",
    "id_from_name",
    "name_for_id",
    "split_claimed_name",
]


class Spool(ProducerSide, WorkerSide, Liveness, Pruning):
    """A spool rooted at one directory. Cheap to construct; holds no open files."""

    def __init__(self, root: str | os.PathLike, *, create: bool = False, clock: Callable[[], float] = time.monotonic):
        """`clock`: this observer's monotonic clock, by which heartbeat ages are judged."""
        self.root = Path(root).absolute()
        self._workers_watch = HeartbeatWatch(clock)  # by status file name
        self._claims_watch = HeartbeatWatch(clock)  # claims without a readable status, by name
        self._unreadable_statuses: set[str] = set()  # status files whose failure was logged
        for state in STATES:
            setattr(self, state, self.root / state)
        if create:
            for state in STATES:
                (self.root / state).mkdir(parents=True, exist_ok=True)
        self._check_layout()
