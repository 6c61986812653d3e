"""`trainer-svc`: train (GRPO), sft (warm-up), config (the resolved config), band, plot, import-gguf,
merge-adapter. Heavy imports happen inside commands, so `--help` and config errors are instant. Exit codes:
protocol.exit_codes (the table in docs/operations.md)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Annotated

import typer

from protocol import exit_codes

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="GRPO trainer using rollout workers through a spool.",
)

ConfigArg = Annotated[Path, typer.Argument(help="Run config (TOML).")]


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO if rank == "0" else logging.WARNING,
        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
    )


def _fail(code: int, message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _load(config: Path, smoke: bool):
    from .config import ConfigError, load

    try:
        return load(config, smoke=smoke)
    except ConfigError as exc:
        raise _fail(exit_codes.USAGE, str(exc)) from None


def check_before_work(cfg, *, need_model: bool = True) -> None:
    """Cheap checks that would otherwise fail after minutes of model loading (PreflightError, with its exit code)."""
    from .rails.preflight import check_model_dir, check_publish_dir, check_run_dir, check_spool

    if need_model:
        check_model_dir(Path(cfg.model.path))
    check_run_dir(cfg.run_dir)
    check_publish_dir(cfg.publish_dir)
    check_spool(cfg)


FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _exit_code_of(exc: Exception) -> int | None:
    """The code `train` exits with for exc: the one its class carries (`exit_code`), CANNOT_WRITE for any write a
    full disk or quota failed; None for anything else, a bug that propagates with its traceback."""
    if isinstance(exc, OSError) and exc.errno in FULL_DISK:
        return exit_codes.CANNOT_WRITE
    return getattr(exc, "exit_code", None)


@app.command("config")
def show_config(config: ConfigArg) -> None:
    """Print the resolved config: each key's value, its default and what it means (docs/config.md)."""
    from .config.reference import resolved

    typer.echo(resolved(_load(config, smoke=False)), nl=False)


@app.command()
def train(
    config: ConfigArg,
    smoke: Annotated[
        bool, typer.Option(help="A tiny shape of the same run (a few small steps), in directories of its own.")
    ] = False,
) -> None:
    """Run GRPO; relaunching with the same run directory resumes from its newest checkpoint."""
    _setup_logging()
    cfg = _load(config, smoke)
    if smoke:
        shared = "" if cfg.rollout.spawn else " (the run's: its workers serve it)"
        typer.echo(
            f"smoke run: run directory {cfg.run_dir}, published weights {cfg.publish_dir}, spool {cfg.spool_dir}"
            f"{shared}; the run's own files are not touched"
        )
    from .learning.reward_functions import find_user_functions

    try:
        find_user_functions(cfg.reward)  # a missing module stops the launch at once
        check_before_work(cfg)
        from .rails.gates import check_config
        from .run.loop import train as run_training

        check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # the cheapest gate, before torch loads
        code = run_training(cfg, stage="grpo_smoke" if smoke else "grpo")
    except Exception as exc:  # each trainer error carries its exit code; a full disk gets CANNOT_WRITE
        failed = _exit_code_of(exc)
        if failed is None:
            raise
        raise _fail(failed, _message(exc, failed, cfg)) from None
    if code == exit_codes.OK:
        import json

        s = json.loads((cfg.run_dir / "stage_result.json").read_text())["summary"]
        if s.get("steps"):
            accuracy = f"accuracy {s['accuracy_last']:.3f}; " if s["accuracy_last"] is not None else ""
            typer.echo(
                f"reward {s['reward_first']:.3f} (first 10 steps) -> {s['reward_last']:.3f} (last 10); "
                f"{accuracy}{s['steps']} steps in {s['wall_s']:.0f} s"
            )
        tensorboard = (
            f"; TensorBoard: `tensorboard --logdir {cfg.run_dir / 'tensorboard'}`" if cfg.log.tensorboard else ""
        )
        typer.echo(
            f"results: {cfg.run_dir / 'stage_result.json'}, "
            f"{cfg.run_dir / 'metrics.jsonl'}; plot: `trainer-svc plot {cfg.run_dir}`{tensorboard}"
        )
    from .run.setup import exit_process

    exit_process(code)


def _message(exc: Exception, code: int, cfg) -> str:
    if code == exit_codes.CANNOT_WRITE:
        return _full_disk_message(exc, cfg)
    # an OSError's own text (NotPrivate: a weight-slot ring another user made or can change) without "[Errno n]"
    return exc.strerror if isinstance(exc, OSError) else str(exc)


def _full_disk_message(exc: OSError, cfg) -> str:
    from .weights.checkpoint import latest

    where = f" ({exc.filename})" if exc.filename else ""
    newest = latest(cfg.run_dir)
    resume = f"checkpoint step {newest.step}" if newest else "the start (no checkpoint yet)"
    return (
        f"a write failed{where}: {exc.strerror or exc}. The disk holding {cfg.run_dir} or {cfg.publish_dir} is full "
        f"or over quota; nothing half written was kept. Free space, then relaunch: the run resumes from {resume}"
    )


@app.command()
def sft(config: ConfigArg) -> None:
    """Supervised warm-up from [sft].base into model.path, stopping at [sft].stop_at_accuracy."""
    _setup_logging()
    cfg = _load(config, False)
    if cfg.sft is None:
        raise _fail(exit_codes.USAGE, f"{config} has no [sft] section (base = the model to start from)")
    from .rails.preflight import PreflightError, check_model_dir

    try:
        check_model_dir(Path(cfg.sft.base))
    except PreflightError as exc:
        raise _fail(exc.exit_code, str(exc)) from None
    from .data import DataError
    from .learning.sft import run_sft

    try:
        report = run_sft(cfg)
    except (FileExistsError, DataError) as exc:
        raise _fail(exit_codes.USAGE, str(exc)) from None
    typer.echo(
        f"warm-up: {report['steps']} steps, sampled accuracy {report['sampled_accuracy']:.2f}; model in {report['out']}"
    )


@app.command("eval-env")
def eval_env(
    config: ConfigArg,
    weights: Annotated[Path, typer.Option(help="Weights directory to evaluate (absolute, readable by the workers).")],
    out: Annotated[Path, typer.Option(help="Output JSONL: one row per input row, with its episodes.")],
    rows: Annotated[
        Path | None, typer.Option(help="JSONL or Parquet rows ([data]'s fields); default: the run's held-out rows.")
    ] = None,
    samples: Annotated[int, typer.Option(min=1, help="Episodes per row.")] = 1,
    temperature: Annotated[float, typer.Option(min=0.0, help="Sampling temperature; 0: greedy.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the episodes (and of their sampling).")] = 0,
) -> None:
    """Run the config's [env] environment over rows through the rollout workers; prints the mean reward."""
    _setup_logging()
    cfg = _load(config, False)
    if cfg.env is None:
        raise _fail(exit_codes.USAGE, f"{config} has no [env] section: name the environment (class = ...)")
    from protocol.evaluation import write_rows

    from .data import DataError, load_problems, read_prompt_file, row_format
    from .envs.errors import EnvError
    from .envs.evaluate import evaluate
    from .learning.model import load_tokenizer
    from .rollout.client import RolloutService
    from .rollout_types import RolloutFailed, RolloutUnavailable, WeightsRef

    try:
        problems = read_prompt_file(rows, row_format(cfg.data)) if rows else load_problems(cfg.data, cfg.run.seed)[1]
        service = RolloutService(cfg, cuda_devices=0 if not cfg.rollout.spawn else None)
        report = evaluate(
            cfg, service, problems, load_tokenizer(cfg.model.path), weights=WeightsRef(str(weights.absolute())),
            samples=samples, temperature=temperature, seed=seed,
        )  # fmt: skip
    except (DataError, EnvError, RolloutFailed, RolloutUnavailable) as exc:  # each carries its exit code
        raise _fail(exc.exit_code, str(exc)) from None
    write_rows(out, report.rows)
    typer.echo(
        f"reward {report.reward:.4f} over {len(report.rows)} rows x {samples} episodes in {report.seconds:.1f} s"
    )


@app.command()
def band(config: ConfigArg) -> None:
    """Keep the prompts the starting model solves sometimes: a band file and its manifest for data.band_file."""
    _setup_logging()
    cfg = _load(config, False)
    from .data import DataError
    from .rails.band import run_band
    from .rails.preflight import PreflightError
    from .rollout_types import RolloutFailed, RolloutUnavailable

    try:
        check_before_work(cfg)
        report = run_band(cfg)
    except (PreflightError, DataError, RolloutUnavailable, RolloutFailed) as exc:  # each carries its exit code
        raise _fail(exc.exit_code, str(exc)) from None
    counts = report["counts"]
    typer.echo(
        f"{report['rows']} prompts in the band ({counts['never']} never solved, {counts['always']} always); "
        f"band file {report['path']}, manifest {report['path']}.manifest.json"
    )


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (holds metrics.jsonl).")],
    out: Annotated[Path | None, typer.Option(help="PNG path; default RUN_DIR/training.png.")] = None,
    follow: Annotated[
        bool,
        typer.Option(help="Redraw while the run goes, each time metrics.jsonl grows, until the run ends (or Ctrl-C)."),
    ] = False,
    every: Annotated[float, typer.Option(min=0.01, help="With --follow: seconds between looks at the run.")] = 10.0,
) -> None:
    """Draw reward, loss, entropy, response length and logprob mismatch against step."""
    from .run.plot import plot as draw

    if follow:
        _follow(run_dir, out, every)
        return
    try:
        path = draw(run_dir, out)
    except ValueError as exc:
        raise _fail(exit_codes.USAGE, str(exc)) from None
    typer.echo(f"plot written to {path}")


def _follow(run_dir: Path, out: Path | None, every: float) -> None:
    from .run.plot import follow

    if not run_dir.is_dir():
        raise _fail(exit_codes.USAGE, f"{run_dir} is not a directory: give the run's run.dir")
    typer.echo(f"following {run_dir}: the plot is redrawn as steps land, until the run ends (Ctrl-C stops)")
    try:
        result = follow(
            run_dir, out, every, lambda png, rows: typer.echo(f"plot written to {png} ({rows} step{'s' * (rows != 1)})")
        )
    except KeyboardInterrupt:
        typer.echo("stopped following")
        return
    except ValueError as exc:
        raise _fail(exit_codes.USAGE, str(exc)) from None
    how = "finished" if result.get("finished") else f"stopped with exit code {result.get('exit_code')}"
    typer.echo(f"the run {how}")


@app.command("merge-adapter")
def merge_adapter(
    adapter_dir: Annotated[
        Path, typer.Argument(help="A LoRA publish or checkpoint directory (its manifest names the base).")
    ],
    out_dir: Annotated[Path, typer.Argument(help="The HF directory to write; an existing one is replaced whole.")],
    base: Annotated[
        Path | None, typer.Option(help="The base model directory; default the one the adapter's manifest names.")
    ] = None,
) -> None:
    """Merge a LoRA adapter into its base model and write the result as a full HF directory (export;
    a rollout worker or model.path loads it as ordinary weights)."""
    from .weights.merge_adapter import MergeRefused
    from .weights.merge_adapter import merge_adapter as merge

    try:
        written = merge(adapter_dir, out_dir, base)
    except MergeRefused as exc:
        raise _fail(exc.exit_code, str(exc)) from None
    typer.echo(
        f"merged {adapter_dir} into {written.path} ({written.bytes / 2**20:.1f} MiB, content id {written.content_id})"
    )


@app.command("import-gguf")
def import_gguf(
    gguf_file: Annotated[Path, typer.Argument(help="A GGUF model file (llama.cpp's format, any quantization).")],
    out_dir: Annotated[Path, typer.Argument(help="The HF directory to write; an existing one is replaced whole.")],
    dtype: Annotated[str, typer.Option(help="The weights' dtype: bfloat16, float16 or float32.")] = "bfloat16",
    expect: Annotated[
        Path | None, typer.Option(help="A pin file: put OUT_DIR in place only if its content id is the pinned one.")
    ] = None,
    write_pin: Annotated[Path | None, typer.Option(help="Then pin the result in this file (for --expect).")] = None,
) -> None:
    """Import a GGUF model as an HF directory (dequantized safetensors, config, tokenizer with its chat
    template, generation config), deterministically, for model.path and the rollout workers."""
    from .weights.gguf_import import ImportFailed, ImportMismatch
    from .weights.gguf_import import import_gguf as run_import
    from .weights.gguf_import import write_pin as pin

    try:
        done = run_import(gguf_file, out_dir, dtype=dtype, expect=expect)
    except (ImportFailed, ImportMismatch) as exc:  # each carries its exit code
        raise _fail(exc.exit_code, str(exc)) from None
    if write_pin is not None:
        pin(done.path, write_pin)
    typer.echo(
        f"{done.path}: {done.parameters:,} parameters in {dtype}, {done.bytes / 1e6:.1f} MB; content id "
        f"{done.content_id}; an assistant turn ends with token id(s) {done.end_of_turn}"
        + (f"; pinned in {write_pin}" if write_pin is not None else "")
    )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
