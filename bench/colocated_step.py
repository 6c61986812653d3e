"""A training step with the worker colocated on the trainer's GPU, generating ahead: does the
next step's generation overlap this step's training and publishing? Target: step <= 1.15 x
max(generation, train + publish).

    python -m bench.colocated_step --model DIR [--steps 40] [--prompts 64] [--samples 8] [--tokens 16]
                                   [--temperature 0.7] [--lr 2e-5] [--spares 16] [--spares-max 160]
                                   [--sleep 0] [--compile off] [--skip 5] [--json OUT]

DIR is an HF model directory (SmolLM2-135M-Instruct in bf16 in docs/BENCHMARKS.md; on a machine
without a GPU any small model, e.g. build/tiny-model, checks the script). The rows are
two-digit additions as chat rows, rendered by the worker with the model's chat template (the
demo's `a+b=` text for a model without one). One `trainer-svc train` launch: `rollout.ahead = 1`,
`rollout.colocate = true` on a GPU (the worker on the trainer's GPU, awake unless --sleep gives
`rollout.colocate_sleep_s`), spares from --spares up to --spares-max as the dead rate asks
(`rollout.spare_prompts_max`; --spares-max 0 keeps --spares fixed), tis, one retry.

Per step, from metrics.jsonl and the spool's answered requests:
- step: the trainer's `step_s`; wait: its `rollout_s` (waiting for the samples, and scoring);
- generation: the worker's time on the step's requests (each result's reload_s + generate_s,
  every attempt of the step): what the overlap has to hide;
- train + publish: the trainer's `train_s + publish_s`.
Medians over the steps after --skip (the first ones start the engine's caches and compile), the
ratio median(step) / max(median(generation), median(train + publish)), retries and spares, and
launch to each step (the metrics file watched as it grows: launch to first step too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench import synthetic
from bench.common import ROOT, read_jsonl, step_engine_seconds, trainer_command, utc_minute

TARGET_RATIO = 1.15


def write_rows(model: Path, path: Path) -> int:
    """Every a + b with a, b in 10..99: for a model with a chat template the chat rows
    configs/smollm2-gpu.toml trains on (one user turn each, rendered by the worker), else the
    demo's `a+b=` text rows."""
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(model).chat_template:
        shutil.copyfile(ROOT / "configs" / "data" / "two_digit_sums.jsonl", path)
        return sum(1 for _ in open(path))
    with open(path, "w") as out:
        for a in range(10, 100):
            for b in range(10, 100):
                out.write(json.dumps({"prompt": f"{a}+{b}=", "gold": str(a + b)}) + "\n")
    return 90 * 90


def config(args, run_dir: Path, rows: Path, gpu: bool) -> dict:
    worker_args = ["--max-model-len", "512" if gpu else "64"]
    return {
        "run": {"dir": str(run_dir), "seed": 0, "cpu_threads": 0 if gpu else 1},
        "model": {"path": str(args.model), "compile": args.compile},
        "data": {"task": "file", "path": str(rows), "held_out": 32},
        "rollout": {
            "rollout_venv": str(ROOT / ".venvs" / "rollout"),
            "prompts_per_step": args.prompts,
            "samples_per_prompt": args.samples,
            "max_tokens": args.tokens,
            "temperature": args.temperature,
            "ahead": 1,
            "max_policy_lag": 1,
            "spare_prompts": args.spares,
            "spare_prompts_max": args.spares_max,
            "colocate": gpu,
            "colocate_sleep_s": args.sleep,
            "worker_args": worker_args,
            "timeout_s": 300.0,
        },
        "train": {"steps": args.steps, "lr": args.lr},
        "loss": {"dead_group_retries": 1, "correction": "tis"},
        "checkpoint": {"every": 10_000, "keep_last": 1},
        "publish": {"keep_last": 3},
    }


def watch(command: list[str], metrics: Path, log_path: Path, timeout_s: float) -> tuple[int, list[float]]:
    """Run the trainer; returns its exit code and, per metrics line, seconds from launch to it."""
    seen: list[float] = []
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if time.monotonic() - started > timeout_s:
                proc.terminate()
                proc.wait(60)
                break
            lines = metrics.read_bytes().count(b"\n") if metrics.exists() else 0
            if lines > len(seen) and lines % 10 == 0:
                print(f"{time.monotonic() - started:.0f} s: {lines} steps", flush=True)
            seen += [time.monotonic() - started] * (lines - len(seen))
            time.sleep(0.02)
    lines = metrics.read_bytes().count(b"\n") if metrics.exists() else 0
    seen += [time.monotonic() - started] * (lines - len(seen))
    return proc.returncode, seen


def summarise(rows: list[dict], worker: dict[int, float], arrived: list[float], skip: int) -> dict:
    kept = [r for r in rows if r["step"] > skip] or rows
    med = {
        "step_s": statistics.median(r["step_s"] for r in kept),
        "wait_s": statistics.median(r["rollout_s"] for r in kept),
        # row "step" is 1-based; request ids name the step 0-based
        "generation_s": statistics.median(worker.get(r["step"] - 1, 0.0) for r in kept),
        "train_s": statistics.median(r["train_s"] for r in kept),
        "publish_s": statistics.median(r["publish_s"] for r in kept),
        "train_publish_s": statistics.median(r["train_s"] + r["publish_s"] for r in kept),
        "score_s": statistics.median(r["score_s"] for r in kept),
    }
    bound = max(med["generation_s"], med["train_publish_s"])
    return {
        "medians": {k: round(v, 4) for k, v in med.items()},
        "step_over_max": round(med["step_s"] / bound, 3) if bound else None,
        "target": TARGET_RATIO,
        "steps_measured": len(kept),
        "steps_with_a_retry": sum(r["retries"] > 0 for r in kept),
        "dead_groups_median": statistics.median(r["dead_groups"] for r in kept),
        "dead_after_retry_total": sum(r["dead_groups_after_retry"] for r in kept),
        "spares_median": statistics.median(r.get("spares", 0) for r in kept),
        "spares_range": [min(r.get("spares", 0) for r in kept), max(r.get("spares", 0) for r in kept)],
        "reward_first_10": round(statistics.fmean(r["reward_first"] for r in rows[:10]), 3),
        "reward_last_10": round(statistics.fmean(r["reward_first"] for r in rows[-10:]), 3),
        "launch_to_first_step_s": round(arrived[0], 1) if arrived else None,
        "launch_to_last_step_s": round(arrived[-1], 1) if arrived else None,
        "per_step": [
            {
                "step": r["step"],
                "step_s": round(r["step_s"], 3),
                "wait_s": round(r["rollout_s"], 3),
                "generation_s": round(worker.get(r["step"] - 1, 0.0), 3),
                "train_s": round(r["train_s"], 3),
                "publish_s": round(r["publish_s"], 3),
                "dead": r["dead_groups"],
                "spares": r.get("spares", 0),
                "retries": r["retries"],
            }
            for r in rows
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="an HF model directory (required but with --tiny)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--spares", type=int, default=16)
    parser.add_argument("--spares-max", type=int, default=160)
    parser.add_argument("--sleep", type=float, default=0.0, help="rollout.colocate_sleep_s; 0: the worker stays awake")
    parser.add_argument("--compile", default="off", choices=["auto", "on", "off"])
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the medians")
    parser.add_argument("--timeout", type=float, default=560.0, help="seconds the launch may take")
    parser.add_argument("--work", type=Path, help="directory for the run (default: a fresh one under /tmp)")
    parser.add_argument("--json")
    parser.add_argument(
        "--tiny", action="store_true", help="a check of the script: no launch, a made-up run summarised"
    )
    args = parser.parse_args()
    if not (args.model or args.tiny):
        parser.error("--model is required")
    import msgspec
    import torch

    gpu = torch.cuda.is_available()
    work = args.work or Path(tempfile.mkdtemp(prefix="colocated-step-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        args.steps, args.skip = 6, 2
        if args.model is None:  # a tokenizer is all the rows need
            from rollout_svc.tiny_model import write_tokenizer

            args.model = work / "tokenizer-only"
            args.model.mkdir()
            write_tokenizer(args.model, max_positions=64)
    args.model = args.model.resolve()
    rows_path = work / "rows.jsonl"
    write_rows(args.model, rows_path)
    run_dir = work / "run"
    config_path = work / "colocated.toml"
    config_path.write_bytes(msgspec.toml.encode(config(args, run_dir, rows_path, gpu)))
    print(f"launching the trainer: {config_path}", flush=True)
    if args.tiny:
        synthetic.stand_in_train(config_path)
        code, arrived = 0, [0.3 * (i + 1) for i in range(args.steps)]
        (work / "trainer.log").write_text("")
    else:
        command = [*trainer_command(), "train", str(config_path)]
        code, arrived = watch(command, run_dir / "metrics.jsonl", work / "trainer.log", args.timeout)
    metrics = run_dir / "metrics.jsonl"
    rows = read_jsonl(metrics) if metrics.exists() else []
    if not rows:
        raise SystemExit(
            f"no step finished (exit {code}); {work / 'trainer.log'}:\n{(work / 'trainer.log').read_text()[-4000:]}"
        )
    worker_log = run_dir / "rollout-worker.log"
    report = {
        "benchmark": "colocated_step",
        "date": utc_minute(),
        "machine": f"{torch.cuda.get_device_name(0) if gpu else 'CPU'}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "exit_code": code,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "worker_sleeps": worker_log.read_text(errors="replace").count("engine asleep") if worker_log.exists() else None,
        **summarise(rows, step_engine_seconds(run_dir / "spool"), arrived, args.skip),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    med = report["medians"]
    print(
        f"step {med['step_s']:.3f} s = wait {med['wait_s']:.3f} + train {med['train_s']:.3f} + publish "
        f"{med['publish_s']:.3f}; generation {med['generation_s']:.3f} s; step / max(generation, train + publish) "
        f"= {report['step_over_max']} (target {TARGET_RATIO}); retries on {report['steps_with_a_retry']} of "
        f"{report['steps_measured']} steps; spares {report['spares_range']}; launch to first step "
        f"{report['launch_to_first_step_s']} s"
    )


if __name__ == "__main__":
    main()
