"""`rollout-svc`: run a rollout worker on a spool."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Rollout worker serving generation requests from a spool.")


@app.callback()
def _root() -> None:
    """Rollout worker serving generation requests from a spool."""


def _default_worker_id() -> str:
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


@app.command()
def serve(
    spool: Annotated[Path, typer.Option(help="Spool directory; its layout is created if missing.")],
    engine: Annotated[str, typer.Option(help="Engine: 'echo' (no model; each completion is its prompt).")] = "echo",
    worker_id: Annotated[Optional[str], typer.Option(help="Stable id, e.g. <host>-gpu0; default <host>-<pid>.")] = None,
    idle_exit: Annotated[float, typer.Option(help="Exit 0 after this many seconds without requests; 0 serves forever.")] = 7200.0,
    lease: Annotated[float, typer.Option(help="Seconds without heartbeat after which our claims are given to others.")] = 30.0,
    heartbeat: Annotated[float, typer.Option(help="Seconds between heartbeats (at most a third of --lease).")] = 2.0,
    max_batch: Annotated[int, typer.Option(help="Most requests claimed per loop turn.")] = 64,
    poll: Annotated[Optional[bool], typer.Option("--poll/--inotify", help="Force polling or inotify; default: poll only on network filesystems.")] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
) -> None:
    """Serve requests from SPOOL until SIGTERM or --idle-exit seconds without work."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from protocol.messages import is_valid_id
    from protocol.spool import Spool, SpoolError

    from .engines import make_engine
    from .worker import Worker, WorkerConfig

    worker_id = worker_id or _default_worker_id()
    if not is_valid_id(worker_id):
        raise typer.BadParameter(f"{worker_id!r} must match [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}", param_hint="--worker-id")
    if heartbeat * 3 > lease:
        raise typer.BadParameter(f"--heartbeat {heartbeat} must be at most a third of --lease {lease}", param_hint="--heartbeat")
    try:
        spool_dir = Spool(spool, create=True)
    except (SpoolError, OSError) as exc:
        typer.echo(f"error: cannot use spool {spool}: {exc}", err=True)
        raise typer.Exit(2) from None
    config = WorkerConfig(
        worker_id=worker_id,
        lease_s=lease,
        heartbeat_s=heartbeat,
        idle_exit_s=idle_exit or None,
        max_batch=max_batch,
        poll=poll,
    )
    try:
        eng = make_engine(engine)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--engine") from None
    raise typer.Exit(Worker(spool_dir, eng, config).serve())


def main() -> None:
    app()
