"""`trainer-svc plot RUN_DIR`: reward, loss, entropy, response length and the trainer/rollout
logprob mismatch against step, from metrics.jsonl, into one PNG.

The reward panel plots `reward_first`, each step's first sampling (the policy's own estimate),
with the trained batch's reward (`reward_trained`, dead groups replaced) as a thin line beside it.

`follow` (`trainer-svc plot --follow`) redraws the PNG each time metrics.jsonl grows, while the run
goes, until its stage_result.json says it ended for good. The PNG is replaced atomically: a
viewer that reloads it never reads half a file."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from pathlib import Path

from protocol import exit_codes
from protocol.fsio import replace_atomic

from .outputs import METRICS, STAGE_RESULT

PANELS = (
    ("reward_first", "reward (first sampling; orange: trained batch)"),
    ("accuracy", "accuracy"),
    ("loss", "loss"),
    ("entropy", "entropy (per token)"),
    ("response_length", "response length (tokens)"),
    ("mismatch_mean", "|trainer - rollout| logprob"),
)


def _value(row: dict, key: str) -> float:
    # Runs logged before reward_first existed have reward_mean, which then meant the trained batch's.
    fallback = row.get("reward_mean", float("nan")) if key == "reward_first" else float("nan")
    return row.get(key, fallback)


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(run_dir: Path, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(run_dir)
    if not rows:
        raise ValueError(f"{run_dir} has no metrics.jsonl rows to plot")
    steps = [r["step"] for r in rows]
    window = max(1, len(rows) // 50)
    fig, axes = plt.subplots(2, 3, figsize=(14, 7), sharex=True)
    for ax, (key, title) in zip(axes.flat, PANELS, strict=False):
        values = [_value(r, key) for r in rows]
        ax.plot(steps, values, color="0.8", linewidth=0.8)
        ax.plot(steps, smooth(values, window), color="C0", linewidth=1.5)
        if key == "reward_first" and all("reward_trained" in r for r in rows):
            ax.plot(steps, smooth([r["reward_trained"] for r in rows], window), color="C1", linewidth=0.8)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("optimizer step")
    fig.suptitle(f"{Path(run_dir).name}: {len(rows)} steps (grey: per step; blue: mean of {window})")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "training.png"
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    replace_atomic(out, png.getvalue(), durable=False)
    return out


def read_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl's rows; a last line the run is still appending (torn) is left for next time."""
    path = Path(run_dir) / METRICS
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if number < len(lines):
                raise ValueError(f"{path} line {number} is not a JSON row") from None
    return rows


def ended(run_dir: Path) -> dict | None:
    """The stage result of a run that ended for good: finished, or stopped otherwise than
    resumably (a resumable stop, exit 75, goes on when relaunched); else None."""
    path = Path(run_dir) / STAGE_RESULT
    try:
        result = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):  # none yet (or an old one being replaced: never torn)
        return None
    return result if result.get("finished") or result.get("exit_code") != exit_codes.RESUMABLE_STOP else None


def follow(
    run_dir: Path, out: Path | None = None, every: float = 10.0, drawn: Callable[[Path, int], None] = lambda p, n: None
) -> dict:
    """Redraw the plot whenever metrics.jsonl has grown, checking every `every` seconds, until
    the run ended for good; returns its stage result. `drawn(png, rows)` follows each draw."""
    metrics, seen = Path(run_dir) / METRICS, None
    while True:
        result = ended(run_dir)  # before the rows: a run that ended has written its last row
        stamp = _stamp(metrics)
        if stamp != seen:
            rows = len(read_rows(run_dir))
            if rows:
                drawn(plot(run_dir, out), rows)
                seen = stamp
        if result is not None:
            return result
        time.sleep(every)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns
