"""`spoolctl`: an operator's view of a spool. Every command reads like `ls`; `--json` for scripts.

spoolctl stats  -s /srv/spool          queue depth, oldest request, live workers
spoolctl ls     -s /srv/spool bad      entries of one or more states, with ages
spoolctl show   -s /srv/spool ID       every file of one request id
spoolctl requeue -s /srv/spool ID      put a request back in requests/ (from bad/, done/...)
spoolctl recover -s /srv/spool         give dead workers' claims back now
spoolctl prune  -s /srv/spool --older-than 7d
spoolctl init   /srv/spool             create the layout
spoolctl eval   -s /srv/spool prompts.jsonl --weights DIR --out out.jsonl
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from .spool import DEFAULT_LEASE_S, STATES, split_claimed_name

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Inspect and repair a rollout spool.")

SpoolOpt = Annotated[Path, typer.Option("--spool", "-s", envvar="SPOOL_DIR", help="Spool directory (or $SPOOL_DIR).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """'90', '90s', '15m', '2h', '7d' -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not match:
        raise typer.BadParameter(f"{text!r} is not a duration; write e.g. 90s, 15m, 2h or 7d")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def format_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


def _open(spool_dir: Path):
    from .spool import Spool, SpoolError

    try:
        return Spool(spool_dir)
    except SpoolError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _emit_json(data) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False))


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for column in columns:
        table.add_column(column, no_wrap=True, overflow="ellipsis")
    for row in rows:
        table.add_row(*row)
    Console(width=max(100, Console().width)).print(table)


@app.command()
def init(spool_dir: Annotated[Path, typer.Argument(help="Directory to create the spool in.")]) -> None:
    """Create the spool layout (tmp, requests, claimed, results, done, bad, workers), and check
    that its filesystem makes hard links and renames files atomically."""
    from .spool import Spool, SpoolError
    from .spool_filesystem import check_filesystem

    try:
        spool = Spool(spool_dir, create=True)
        check_filesystem(spool.root)
    except SpoolError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"spool ready at {spool.root}")


@app.command("ls")
def list_entries(
    spool_dir: SpoolOpt,
    states: Annotated[
        list[str] | None, typer.Argument(help=f"States to list: {', '.join(STATES)}; default all but tmp.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List entries by state, oldest first, with their ages."""
    spool = _open(spool_dir)
    states = states or [s for s in STATES if s != "tmp"]
    for state in states:
        if state not in STATES:
            raise typer.BadParameter(f"unknown state {state!r}; one of {', '.join(STATES)}")
    now = time.time()
    listing = {
        state: [{"name": e.name, "age_s": round(now - e.mtime, 3), "bytes": e.size} for e in spool.entries(state)]
        for state in states
    }
    if as_json:
        _emit_json(listing)
        return
    for state, entries in listing.items():
        typer.echo(f"{state}/ ({len(entries)})")
        for e in entries:
            typer.echo(f"  {format_age(e['age_s']):>7}  {e['bytes']:>9}  {e['name']}")


@app.command()
def show(
    spool_dir: SpoolOpt, request_id: Annotated[str, typer.Argument(help="Request id.")], as_json: JsonOpt = False
) -> None:
    """Show every file of one request id: the request, its claim, its result."""
    spool = _open(spool_dir)
    paths = spool.locate(request_id)
    if not paths:
        typer.echo(f"error: no file of request {request_id!r} in {spool.root}", err=True)
        raise typer.Exit(1)
    shown = {str(path.relative_to(spool.root)): _content(path) for path in paths}
    if as_json:
        _emit_json(shown)
        return
    for name, content in shown.items():
        typer.echo(f"== {name}")
        typer.echo(json.dumps(_summarise(content), indent=2))


def _content(path: Path):
    """A spool file's JSON, or {"unreadable": why}: never blocks on a FIFO, never follows a
    symlink, never reads more than a result may hold, and survives any content (deep nesting included)."""
    from .fsio import read_regular_file
    from .spool_producer import MAX_RESULT_BYTES

    try:
        return json.loads(read_regular_file(path, MAX_RESULT_BYTES))
    except (OSError, ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        if isinstance(exc, RecursionError):
            return {"unreadable": "nested too deeply to be a spool message"}
        return {"unreadable": str(exc)}


def _summarise(content):
    """Results carry [prompt][sample][token] lists; for people, show texts and sizes only."""
    if not isinstance(content, dict) or "ok" not in content:
        return content
    summary = {k: v for k, v in content.items() if k not in ("token_ids", "logprobs", "prompt_token_ids")}
    summary["generated_tokens"] = sum(len(t) for p in content.get("token_ids", []) for t in p)
    return summary


@app.command()
def requeue(
    spool_dir: SpoolOpt,
    request_id: Annotated[str, typer.Argument(help="Request id.")],
    force: Annotated[bool, typer.Option(help="Also take it from a live worker's claim.")] = False,
) -> None:
    """Put a request back in requests/ (from bad/, done/ or a dead worker's claim) to run again.

    Its old result, if any, is kept in done/ as <id>.result.superseded-<time>.json."""
    from .admin import RequeueError, requeue_request

    spool = _open(spool_dir)
    try:
        source = requeue_request(spool, request_id, force=force)
    except RequeueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"requeued {request_id} from {source.parent.name}/")


@app.command()
def recover(
    spool_dir: SpoolOpt,
    lease: Annotated[
        float, typer.Option(help="Lease for claims whose worker left no status file (s).")
    ] = DEFAULT_LEASE_S,
) -> None:
    """Give claims of dead workers (heartbeat unchanged for their lease) back to requests/.

    A worker is dead once its heartbeat has stood still for half its lease as this command
    watched it (no clock of another host is trusted), so this takes that long."""
    spool = _open(spool_dir)
    leases = {s.worker_id: s.lease_s for _, s in spool.statuses() if s is not None}
    holders = {split_claimed_name(e.name)[1] for e in spool.entries("claimed")}
    watch_s = max([leases.get(w, lease) for w in holders], default=0.0) / 2
    if watch_s:
        typer.echo(f"watching the heartbeats of {len(holders)} workers with claims for {watch_s:.1f} s", err=True)
    recovered = spool.recover_stale(lease)
    deadline = time.monotonic() + watch_s
    while time.monotonic() < deadline:
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        recovered += spool.recover_stale(lease)
    typer.echo(f"recovered {len(recovered)} claims" + (": " + ", ".join(recovered) if recovered else ""))


@app.command()
def prune(
    spool_dir: SpoolOpt,
    older_than: Annotated[
        str, typer.Option(help="Delete done/ entries archived longer ago than this (90s, 15m, 2h, 7d).")
    ],
    tmp_older_than: Annotated[str, typer.Option(help="Delete tmp/ leftovers older than this.")] = "1h",
) -> None:
    """Delete old entries of done/ and leftover scratch files of tmp/."""
    spool = _open(spool_dir)
    removed = spool.prune(done_older_than_s=parse_duration(older_than), tmp_older_than_s=parse_duration(tmp_older_than))
    typer.echo(
        f"removed {removed['done']} from done/, {removed['tmp']} "
        f"from tmp/, {removed['workers']} dead workers' status files"
    )


@app.command()
def stats(spool_dir: SpoolOpt, as_json: JsonOpt = False) -> None:
    """Queue depth per state, the oldest waiting request, and every worker with what it does."""
    from .admin import spool_stats

    report = spool_stats(_open(spool_dir))
    if as_json:
        _emit_json(report)
        return
    counts = "  ".join(f"{state} {n}" for state, n in report["counts"].items())
    typer.echo(f"spool {report['spool']}\n  {counts}")
    oldest = report["oldest_request_age_s"]
    typer.echo(f"  oldest waiting request: {format_age(oldest) if oldest is not None else '-'}")
    rows = [
        [
            w["worker_id"],
            "live" if w["live"] else "DEAD",
            w.get("state") or "?",
            w.get("current_request") or "-",
            format_age(w["heartbeat_age_s"]),
            f"{w.get('host', '?')}:{w.get('pid', '?')}",
            w.get("device") or "?",
            str(w.get("requests_ok", "")),
            str(w.get("requests_failed", "")),
            (w.get("last_error") or "")[:60],
        ]
        for w in report["workers"]
    ]
    columns = ["worker", "", "state", "request", "beat", "host:pid", "device", "ok", "failed", "last error"]
    _table(f"workers ({report['live_workers']} live)", columns, rows)


@app.command("eval")
def evaluate(
    spool_dir: SpoolOpt,
    prompts: Annotated[
        Path,
        typer.Argument(
            help="JSONL or Parquet rows: a prompt (text, or a conversation of {role, content} turns) and, where "
            "known, an answer ('#### N' as GSM8K writes it, a \\boxed{} solution, or the answer itself)."
        ),
    ],
    weights: Annotated[Path, typer.Option(help="Weights directory to evaluate (absolute, readable by the workers).")],
    out: Annotated[Path, typer.Option(help="Where to write completions (JSONL).")],
    max_tokens: Annotated[int, typer.Option(help="Tokens per completion.")] = 256,
    n_samples: Annotated[int, typer.Option(help="Completions per prompt.")] = 1,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    prompt_field: Annotated[str, typer.Option(help="The prompt's field; default: prompt, messages or question.")] = "",
    answer_field: Annotated[str, typer.Option(help="The answer's field; default: gold, answer or solution.")] = "",
    template: Annotated[str, typer.Option(help="Text prompts built from row fields, e.g. '{question}\\nA:'.")] = "",
    system_prompt: Annotated[str, typer.Option(help="A system turn added to each conversation without one.")] = "",
    chat: Annotated[
        bool, typer.Option(help="Send text prompts as a user turn, rendered with the chat template.")
    ] = False,
    prompts_per_request: Annotated[int, typer.Option(help="Prompts per spool request.")] = 64,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for all results.")] = 3600.0,
) -> None:
    """Run an eval through the rollout workers serving SPOOL; prints accuracy over the rows with answers."""
    from .client import SpoolClient, WaitError
    from .evaluation import RowError, RowFormat, read_rows, run_eval, write_rows

    fmt = RowFormat(prompt_field, answer_field, template, system_prompt, chat)
    try:
        rows = read_rows(prompts, fmt)
    except (RowError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    spool = _open(spool_dir)
    try:
        with SpoolClient(spool.root, create=False) as client:
            report = run_eval(
                client,
                rows,
                weights_dir=str(weights.absolute()),
                max_tokens=max_tokens,
                n_samples=n_samples,
                temperature=temperature,
                prompts_per_request=prompts_per_request,
                timeout_s=timeout,
            )
    except (WaitError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    write_rows(out, report.rows)
    accuracy = "" if report.accuracy is None else f", accuracy {report.accuracy:.3f}"
    typer.echo(f"{len(rows)} prompts in {report.seconds:.1f} s{accuracy}; completions in {out}")


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
