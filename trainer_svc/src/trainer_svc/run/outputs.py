"""What a run leaves in its directory and shows: metrics.jsonl, stage_result.json, the banner,
the progress bar on a terminal, and the tracking backends (trainer_svc.run.trackers), each sent a
row only after metrics.jsonl holds it.

Only rank 0 writes them: `Outputs` holds its sinks; other ranks get `Outputs.silent()`, whose
sinks do nothing, so the training loop reads the same on every rank.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol import exit_codes

from ..records import StepLog, write_json_atomic

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
STAGE_RESULT = "stage_result.json"


class MetricsLog(StepLog):
    """run_dir/metrics.jsonl: a row per optimizer step."""

    def __init__(self, run_dir: Path, resumed_step: int, checkpoint_row: dict | None = None):
        super().__init__(Path(run_dir) / METRICS, resumed_step, checkpoint_row)


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / METRICS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def summary(rows: list[dict], window: int = 10) -> dict:
    """Reward at the start and the end of the run: the mean of the first and last `window` steps
    of `reward_mean`, each step's first sampling (before dead groups were replaced)."""
    if not rows:
        return {"steps": 0}
    rewards = [r["reward_mean"] for r in rows]
    first, last = rewards[:window], rewards[-window:]
    return {
        "steps": rows[-1]["step"],
        "reward_first": sum(first) / len(first),
        "reward_last": sum(last) / len(last),
        "reward_gain": sum(last) / len(last) - sum(first) / len(first),
        # Over the last steps that measured it (rows with a gold); None where none did.
        "accuracy_last": _mean_or_none([r["accuracy"] for r in rows[-window:] if "accuracy" in r]),
        "mismatch_mean": sum(r["mismatch_mean"] for r in rows) / len(rows),
        "mismatch_max": max(r["mismatch_max"] for r in rows),
        "dead_groups": sum(r["dead_groups"] for r in rows),
        "dead_groups_after_retry": sum(r["dead_groups_after_retry"] for r in rows),
        "wall_s": sum(r["step_s"] for r in rows),
    }


def _mean_or_none(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class Progress:
    """A tqdm bar on a terminal. Where stderr is a file (nohup, systemd, a scheduler's log) a bar
    would never draw: a log line per step instead (`step_line`), at most one every `every_s`
    seconds (`log.every_s`); the first and the last step, and a step with a canary, always."""

    def __init__(
        self,
        total: int,
        initial: int,
        every_s: float = 10.0,
        *,
        terminal: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.bar, self.total, self.every_s, self.clock = None, total, every_s, clock
        self.last_line: float | None = None  # when the last step line was logged
        if sys.stderr.isatty() if terminal is None else terminal:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, row: dict) -> None:
        if self.bar is not None:
            accuracy = {"acc": f"{row['accuracy']:.2f}"} if "accuracy" in row else {}
            self.bar.set_postfix(
                reward=f"{row['reward_mean']:.3f}", **accuracy, loss=f"{row['loss']:.3f}", refresh=False
            )
            self.bar.update(1)
            return
        if self.due(row):
            log.info("%s", step_line(row, self.total))

    def due(self, row: dict) -> bool:
        """Whether `row` gets a log line now (and, if so, the throttle counts from now)."""
        now = self.clock()
        always = self.last_line is None or row.get("step", 0) >= self.total or "canary_accuracy" in row
        if always or now - self.last_line >= self.every_s:
            self.last_line = now
            return True
        return False

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


PHASES = ("rollout_s", "train_s", "publish_s", "save_s")


def step_line(row: dict, total: int) -> str:
    """`step 12/200: reward 0.431, accuracy 0.50, loss 0.012; 0.57 s (rollout 0.31 s the longest),
    20514 generated tokens/s`: a step as a log line (`, canary 0.40` after the loss on a canary step)."""
    accuracy = f", accuracy {row['accuracy']:.2f}" if "accuracy" in row else ""
    canary = f", canary {row['canary_accuracy']:.2f}" if "canary_accuracy" in row else ""
    reward, loss = row.get("reward_mean", float("nan")), row.get("loss", float("nan"))  # any row a caller logs
    slowest = max(PHASES, key=lambda k: row.get(k, 0.0))
    rate = ""
    if row.get("generated_tokens") and row.get("generate_s"):
        rate = f", {row['generated_tokens'] / row['generate_s']:.0f} generated tokens/s"
    return (
        f"step {row.get('step', '?')}/{total}: reward {reward:.3f}{accuracy}, loss {loss:.3f}{canary}; "
        f"{row.get('step_s', 0.0):.2f} s ({slowest.removesuffix('_s')} {row.get(slowest, 0.0):.2f} s the longest)"
        f"{rate}"
    )


class Silent:
    """A sink that does nothing: what ranks other than 0 write to."""

    def write(self, row: dict) -> None:
        pass

    def update(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass

    def row(self, row: dict) -> None:
        pass

    def end(self, result: dict) -> None:
        pass


@dataclass
class Outputs:
    """Where a run reports: metrics lines, the progress bar, the tracking backends, the stage result."""

    run_dir: Path | None  # None: report nothing (ranks other than 0)
    metrics: MetricsLog | Silent
    progress: Progress | Silent
    tracking: Any = field(default_factory=Silent)  # trackers.Tracking, or Silent

    @classmethod
    def open(
        cls,
        run_dir: Path,
        total_steps: int,
        resumed_step: int,
        checkpoint_row: dict | None = None,
        tracking: Any = None,
        line_every_s: float = 10.0,
    ) -> Outputs:
        """`line_every_s`: log.every_s, the fewest seconds between two step lines (Progress)."""
        metrics = MetricsLog(run_dir, resumed_step, checkpoint_row)
        return cls(run_dir, metrics, Progress(total_steps, resumed_step, line_every_s), tracking or Silent())

    @classmethod
    def silent(cls) -> Outputs:
        return cls(None, Silent(), Silent())

    def step(self, row: dict) -> None:
        self.metrics.write(row)  # the record first: a backend never holds a row metrics.jsonl lacks
        self.progress.update(row)
        self.tracking.row(row)

    def stage_result(self, result: dict) -> None:
        if self.run_dir is not None:
            write_json_atomic(self.run_dir / STAGE_RESULT, result)
            log.info("stage result: %s", self.run_dir / STAGE_RESULT)
            self.tracking.end(result)

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()
        self.tracking.close()


def banner(cfg, stage: str, resumed_from: Path | None, n_problems: int, gate_figures: dict) -> dict:
    """What the run is, in one record: logged at start and kept in stage_result.json."""
    from ..weights.sync import describe_weight_sync  # torch: imported where a run sets up

    band = gate_figures.get("band")
    return {
        "stage": stage,
        "substrate": cfg.model.path,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "band_file": cfg.data.band_file or None,
        "band_prompts": band["rows"] if band else None,
        "task": {"kind": cfg.data.task, "train_problems": n_problems, "held_out": cfg.data.held_out},
        "shape": {
            "prompts_per_step": cfg.rollout.prompts_per_step,
            "G": cfg.rollout.samples_per_prompt,
            "max_response_len": cfg.rollout.max_tokens,
            "loss_denominator": cfg.loss.denominator,
            "policy_loss": f"{cfg.loss.policy} (clip {cfg.loss.clip_low}, {cfg.loss.clip_high})",
            "optimizer_steps": cfg.train.steps,
            "grad_accum": cfg.train.grad_accum,
            "ahead": cfg.rollout.ahead,
            "fan_out": cfg.rollout.fan_out or "one request per live worker",
        },
        "ceiling": gate_figures["ceiling"],
        "memory": gate_figures.get("memory"),
        "topology": {
            **gate_figures["topology"],
            "rollout": "spawned worker" if cfg.rollout.spawn else f"workers on {cfg.spool_dir}",
        },
        "weight_sync": describe_weight_sync(cfg),
        "safety": f"grad clip {cfg.train.max_grad_norm}, canary every {cfg.canary.every or 'off'}, "
        f"tripwire {'armed' if cfg.tripwire.armed else 'off'} (window {cfg.tripwire.window}), "
        f"policy lag <= {cfg.rollout.max_policy_lag}",
    }


def stage_result(
    *,
    stage: str,
    banner: dict,
    exit_code: int,
    rows: list[dict],
    checkpoint: Path | None,
    canary_history: list,
    tripwire: dict,
) -> dict:
    """The run's end in one record (stage_result.json): how it ended, its summary, its banner."""
    totals = summary(rows)
    return {
        "stage": stage,
        "exit_code": exit_code,
        "finished": exit_code == exit_codes.OK,
        "summary": totals,
        "banner": banner,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "canary_history": canary_history,
        "collapse_tripwire": tripwire,
        "dead_groups": {
            "initial": sum(r["dead_groups"] for r in rows),
            "after_retry": sum(r["dead_groups_after_retry"] for r in rows),
            "replaced_by_spares": sum(r.get("spares_used", 0) for r in rows),  # absent in older runs
            "retries": sum(r["retries"] for r in rows),
        },
        "mismatch": {"mean": totals.get("mismatch_mean"), "max": totals.get("mismatch_max")},
    }
