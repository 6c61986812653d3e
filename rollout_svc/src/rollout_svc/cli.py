"""`rollout-svc`: run a rollout worker on a spool; build the tiny test model."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Rollout worker serving generation requests from a spool.")

log = logging.getLogger("rollout_svc")


@app.callback()
def _root() -> None:
    """Rollout worker serving generation requests from a spool."""


def _default_worker_id() -> str:
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


def _device(engine: str) -> str:
    if engine != "vllm":
        return "cpu"
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    return f"cuda:{os.environ.get('CUDA_VISIBLE_DEVICES', '0')}"


@app.command()
def serve(
    spool: Annotated[Path, typer.Option(help="Spool directory; its layout is created if missing.")],
    engine: Annotated[str, typer.Option(help="'vllm', or 'echo' (no model; each completion is its prompt).")] = "vllm",
    worker_id: Annotated[Optional[str], typer.Option(help="Stable id, e.g. <host>-gpu0; default <host>-<pid>.")] = None,
    allowed_root: Annotated[Optional[list[Path]], typer.Option(help="Only serve weights under this directory (repeatable).")] = None,
    weights: Annotated[Optional[Path], typer.Option(help="Load these weights at start instead of at the first request.")] = None,
    idle_exit: Annotated[float, typer.Option(help="Exit 0 after this many seconds without requests; 0 serves forever.")] = 7200.0,
    lease: Annotated[float, typer.Option(help="Seconds without heartbeat after which our claims are given to others.")] = 30.0,
    heartbeat: Annotated[float, typer.Option(help="Seconds between heartbeats (at most a third of --lease).")] = 2.0,
    stop_grace: Annotated[float, typer.Option(help="After SIGTERM, seconds the batch in hand may still run before its requests are given back.")] = 60.0,
    max_batch: Annotated[int, typer.Option(help="Most requests per engine call.")] = 64,
    max_sequences: Annotated[int, typer.Option(help="Most completions (prompts x samples) per engine call.")] = 4096,
    max_wait: Annotated[float, typer.Option(help="A request waiting longer is served next, whatever its weights.")] = 60.0,
    dtype: Annotated[str, typer.Option(help="vllm: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16.")] = "auto",
    max_model_len: Annotated[Optional[int], typer.Option(help="vllm: prompt plus completion limit; default the model's.")] = None,
    kv_cache_gib: Annotated[float, typer.Option(help="vllm on CPU: KV cache size in GiB.")] = 1.0,
    gpu_memory_utilization: Annotated[float, typer.Option(help="vllm on GPU: fraction of the device memory to use.")] = 0.85,
    seed: Annotated[int, typer.Option(help="vllm: engine seed (requests may carry their own).")] = 0,
    metrics_dir: Annotated[Optional[Path], typer.Option(help="Write a Prometheus textfile here (node_exporter's textfile collector).")] = None,
    poll: Annotated[Optional[bool], typer.Option("--poll/--inotify", help="Force polling or inotify; default: poll only on network filesystems.")] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
) -> None:
    """Serve requests from SPOOL until SIGTERM or --idle-exit seconds without work."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from protocol.messages import is_valid_worker_id
    from protocol.spool import Spool, SpoolError

    from .engines import ENGINES, make_engine
    from .metrics import Metrics
    from .notify import Notifier
    from .scheduling import Limits
    from .weights import WeightsPolicy
    from .worker import Worker, WorkerConfig

    worker_id = worker_id or _default_worker_id()
    if not is_valid_worker_id(worker_id):
        raise typer.BadParameter(f"{worker_id!r} must match [A-Za-z0-9][A-Za-z0-9._-]{{0,63}}", param_hint="--worker-id")
    if heartbeat * 3 > lease:
        raise typer.BadParameter(f"--heartbeat {heartbeat} must be at most a third of --lease {lease}", param_hint="--heartbeat")
    if engine not in ENGINES:
        raise typer.BadParameter(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}", param_hint="--engine")
    for root in allowed_root or []:
        if not root.is_dir():
            raise typer.BadParameter(f"{root} is not a directory", param_hint="--allowed-root")
    try:
        spool_dir = Spool(spool, create=True)
    except (SpoolError, OSError) as exc:
        typer.echo(f"error: cannot use spool {spool}: {exc}", err=True)
        raise typer.Exit(2) from None
    if engine == "vllm" and not allowed_root:
        log.warning("no --allowed-root given: any readable directory named by a request will be loaded")
    options = {}
    if engine == "vllm":
        options = dict(
            policy=WeightsPolicy([str(r) for r in allowed_root or []]),
            device=_device(engine),
            dtype=dtype,
            max_model_len=max_model_len,
            kv_cache_gib=kv_cache_gib,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
        )
    config = WorkerConfig(
        worker_id=worker_id,
        lease_s=lease,
        heartbeat_s=heartbeat,
        idle_exit_s=idle_exit or None,
        stop_grace_s=stop_grace,
        limits=Limits(max_requests=max_batch, max_sequences=max_sequences, max_wait_s=max_wait),
        poll=poll,
        preload=str(weights.absolute()) if weights else None,
    )
    metrics = None
    if metrics_dir is not None:
        metrics_dir.mkdir(parents=True, exist_ok=True)
        metrics = Metrics(metrics_dir, worker_id)
    worker = Worker(spool_dir, make_engine(engine, **options), config, notifier=Notifier(), metrics=metrics)
    raise typer.Exit(worker.serve())


@app.command("tiny-model")
def tiny_model(
    out: Annotated[Path, typer.Argument(help="Directory to create (must not exist).")],
    seed: Annotated[int, typer.Option(help="Weights seed: the same seed gives identical files.")] = 0,
    layers: Annotated[int, typer.Option(help="Decoder layers.")] = 2,
    hidden: Annotated[int, typer.Option(help="Hidden size, a multiple of 64.")] = 128,
    init_std: Annotated[float, typer.Option(help="Initialisation std: 0.02 to train; wider gives clearer greedy outputs.")] = 0.02,
) -> None:
    """Build a tiny Llama model with a character tokenizer, offline (tests, demo, smoke runs)."""
    from .tiny_model import build

    try:
        path = build(out, seed=seed, layers=layers, hidden=hidden, init_std=init_std)
    except (FileExistsError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"tiny model written to {path}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
