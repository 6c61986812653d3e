"""Operator actions on a spool that go beyond one message: statistics and requeueing."""

from __future__ import annotations

import os
import time

from .spool import STATES, Spool, name_for_id, split_claimed_name


class RequeueError(RuntimeError):
    """The request cannot be requeued; the message says why and what to do."""


def spool_stats(spool: Spool, now: float | None = None) -> dict:
    """Counts per state, age of the oldest waiting request, and every worker's status."""
    now = time.time() if now is None else now
    counts = {state: len(os.listdir(spool.root / state)) for state in STATES}
    pending = spool.pending()
    workers = []
    for entry, status in spool.statuses():
        age = now - entry.mtime
        row = {"worker_id": entry.name.removesuffix(".json"), "heartbeat_age_s": round(age, 3), "live": False}
        if status is not None:
            row.update(
                live=age <= status.lease_s,
                state=status.state,
                current_request=status.current_request,
                host=status.host,
                pid=status.pid,
                device=status.device,
                engine=status.engine,
                weights_dir=status.weights_dir,
                last_error=status.last_error,
                **{k: getattr(status.counters, k) for k in status.counters.__struct_fields__},
            )
        else:
            row["last_error"] = "status file unreadable"
        workers.append(row)
    return {
        "spool": str(spool.root),
        "counts": counts,
        "oldest_request_age_s": round(now - pending[0].mtime, 3) if pending else None,
        "live_workers": sum(w["live"] for w in workers),
        "workers": workers,
    }


def requeue_request(spool: Spool, request_id: str, *, force: bool = False) -> os.PathLike:
    """Move a request back into requests/ so it runs again; returns where it came from.

    Sources, in order: a claim (only of a dead worker, unless `force`), bad/, done/. Any result
    already published is archived first as done/<id>.result.superseded-<time>.json, otherwise
    the worker would see the old result and skip the request.
    """
    target = spool.request_path(request_id)
    if os.path.lexists(target):
        raise RequeueError(f"{request_id} is already waiting in requests/")
    live = {w.worker_id for w in spool.live_workers()}
    source = None
    for entry in spool.entries("claimed"):
        original, worker_id = split_claimed_name(entry.name)
        if original == name_for_id(request_id):
            if worker_id in live and not force:
                raise RequeueError(
                    f"{request_id} is being served by live worker {worker_id}; wait for its result, "
                    "or pass --force to take it back"
                )
            source = entry.path
    for candidate in (spool.bad_path(name_for_id(request_id)), spool.archived_request_path(request_id)):
        if source is None and os.path.lexists(candidate):
            source = candidate
    if source is None:
        raise RequeueError(
            f"no request file for {request_id} in claimed/, bad/ or done/ of {spool.root}; submit it again instead"
        )
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for old in (spool.result_path(request_id), spool.consumed_result_path(request_id)):
        if os.path.lexists(old):
            os.rename(old, spool.done / f"{request_id}.result.superseded-{stamp}.json")
    os.rename(source, target)
    os.utime(target)  # queue time starts now; the scan order puts it behind what is waiting
    return source
