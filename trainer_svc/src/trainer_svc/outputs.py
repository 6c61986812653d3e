"""What a run leaves in its directory: metrics.jsonl, stage_result.json, the resolved config,
and the progress bar on a terminal."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

METRICS = "metrics.jsonl"
STAGE_RESULT = "stage_result.json"


def write_text_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a part."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def write_json_atomic(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, default=str) + "\n")


class MetricsLog:
    """One JSON line per optimizer step. On resume, lines of steps after the checkpoint are
    dropped: those steps will be run again."""

    def __init__(self, run_dir: Path, resumed_step: int):
        self.path = run_dir / METRICS
        if self.path.exists():
            lines = [line for line in self.path.read_text().splitlines() if line.strip()]
            if lines and not _parses(lines[-1]):  # torn by a power cut or a full disk: redone anyway
                lines.pop()
            kept = [line for line in lines if json.loads(line)["step"] <= resumed_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a", buffering=1)

    def write(self, row: dict) -> None:
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


def _parses(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / METRICS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def summary(rows: list[dict], window: int = 10) -> dict:
    """Reward at the start and the end of the run: the mean of the first and last `window` steps."""
    if not rows:
        return {"steps": 0}
    rewards = [r["reward_mean"] for r in rows]
    first, last = rewards[:window], rewards[-window:]
    return {
        "steps": rows[-1]["step"],
        "reward_first": sum(first) / len(first),
        "reward_last": sum(last) / len(last),
        "reward_gain": sum(last) / len(last) - sum(first) / len(first),
        "accuracy_last": sum(r["accuracy"] for r in rows[-window:]) / len(rows[-window:]),
        "mismatch_mean": sum(r["mismatch_mean"] for r in rows) / len(rows),
        "mismatch_max": max(r["mismatch_max"] for r in rows),
        "dead_groups": sum(r["dead_groups"] for r in rows),
        "dead_groups_after_retry": sum(r["dead_groups_after_retry"] for r in rows),
        "wall_s": sum(r["step_s"] for r in rows),
    }


class Progress:
    """A tqdm bar on a terminal; nothing when stderr is a file (logs stay readable)."""

    def __init__(self, total: int, initial: int):
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, row: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.2f}", loss=f"{row['loss']:.3f}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
