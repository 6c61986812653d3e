"""What the tiny modes of the benchmarks that launch the trainer summarise in place of a launch: a run
directory of a few steps as `trainer-svc train` leaves it, written here in a moment.

A tiny mode writes the config the benchmark would launch, has trainer_svc load it (so a config the
trainer would refuse fails the check), and then `stand_in_train` writes the run the launch would
have left: metrics.jsonl (every key of the trainer's step line), canary.jsonl, stage_result.json,
the spool's answered results of each step (their names and timings as the worker writes them) and
the worker's log lines the benchmarks read. The figures are made up; the code that reads them is
the benchmark's own. Standard library and trainer_svc.config only.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import tomllib


def metrics_rows(steps: int) -> list[dict]:
    """`steps` of the trainer's metrics lines, every key it writes, the reward rising."""
    rows = []
    for step in range(1, steps + 1):
        reward = min(1.0, 0.1 + 0.8 * step / steps)
        rows.append({
            "step": step, "reward_mean": reward, "reward_first": reward, "reward_trained": reward,
            "reward_std": 0.3, "accuracy": reward, "format_rate": 1.0, "reward/correct": reward,
            "reward/format": 0.0, "reward/overlong": 0.0, "response_length": 4.0, "generated_tokens": 64,
            "dead_groups": step % 2, "dead_groups_after_retry": 0, "retries": step % 2, "staleness_mean": 0.5,
            "dropped_stale": 0, "spares_used": 0, "spares": step % 3, "generate_s": 0.2, "score_s": 0.001,
            "loss": 0.01, "entropy": 2.0, "kl": 0.0, "clip_fraction_low": 0.0, "clip_fraction_high": 0.0,
            "grad_norm": 0.5, "lr": 1e-4, "mismatch_mean": 1e-7, "mismatch_max": 1e-6 * step, "ratio_mean": 1.0,
            "ratio_max": 1.0, "corrected_fraction": 0.0, "kl_engine": 0.0, "micro_batches": 2,
            "rollout_s": 0.2, "train_s": 0.1 + 0.001 * step, "publish_s": 0.01, "save_s": 0.0, "step_s": 0.32,
        })  # fmt: skip
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def worker_log(steps: int, sequences: int) -> str:
    """The worker's lines that the benchmarks parse: its engine build, a reload and an engine call
    a step, a sleep between steps."""
    lines = [
        "t INFO rollout_svc.engines.vllm_host[7]: engine built for /m in 9.5 s (CUDA graphs FULL_DECODE_ONLY)",
        "t INFO rollout_svc.engines.vllm: engine process 7 built for /m in 12.0 s (CUDA graphs FULL_DECODE_ONLY)",
    ]
    for step in range(steps):
        lines += [
            f"t INFO vllm_host[7]: reloaded /s/slot_{step % 2} in 0.050 s (weights and check 0.040 s, of it waiting "
            "for the files' sums 0.001 s; prefix cache 0.009 s)",
            f"t INFO vllm_host[7]: generated {sequences} sequences in 0.200 s (LLM.generate 0.180 s)",
            "t INFO rollout_svc.worker: engine asleep",
        ]
    return "\n".join(lines) + "\n"


def write_run(run_dir: Path, steps: int, sequences: int = 16) -> Path:
    """A run directory of `steps` steps as `trainer-svc train` leaves one; returns it."""
    run_dir = Path(run_dir)
    rows = metrics_rows(steps)
    write_jsonl(run_dir / "metrics.jsonl", rows)
    now = time.time()
    canary = [{"step": s, "accuracy": r, "reward": r, "time": now + s} for s, r in ((0, 0.1), (steps, 0.5))]
    write_jsonl(run_dir / "canary.jsonl", canary)
    first, last = rows[:10], rows[-10:]
    summary = {
        "steps": steps,
        "reward_first": sum(r["reward_first"] for r in first) / len(first),
        "reward_last": sum(r["reward_first"] for r in last) / len(last),
        "mismatch_max": max(r["mismatch_max"] for r in rows),
    }
    summary["reward_gain"] = summary["reward_last"] - summary["reward_first"]
    stage = {
        "summary": summary,
        "canary_history": [{"step": c["step"], "accuracy": c["accuracy"]} for c in canary],
        "banner": {"shape": {"ahead": 1}, "weight_sync": "directories"},
    }
    (run_dir / "stage_result.json").write_text(json.dumps(stage, indent=1) + "\n")
    done = run_dir / "spool" / "done"
    done.mkdir(parents=True, exist_ok=True)
    for step in range(steps):  # request ids as trainer_svc names a step's calls (0-based steps)
        timings = {"queued_s": 0.001, "reload_s": 0.05, "generate_s": 0.15}
        (done / f"l0-train-s{step:08d}-a0-p0-0.result.json").write_text(json.dumps({"timings": timings}))
    (run_dir / "rollout-worker.log").write_text(worker_log(steps, sequences))
    return run_dir


def stand_in_train(config_path: Path) -> Path:
    """In place of `trainer-svc train CONFIG`: the config loaded as the trainer loads it (refused
    as the trainer refuses it), then the run its launch would leave in run.dir; returns run.dir."""
    from trainer_svc.config import load

    load(config_path)
    raw = tomllib.loads(Path(config_path).read_text())
    steps = raw.get("train", {}).get("steps", 3)
    rollout = raw.get("rollout", {})
    sequences = rollout.get("prompts_per_step", 4) * rollout.get("samples_per_prompt", 4)
    return write_run(Path(raw["run"]["dir"]), steps, sequences)
