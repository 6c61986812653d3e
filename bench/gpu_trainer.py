"""The trainer on GPUs: one GPU in bf16, then two GPUs with FSDP2 over NCCL, same config.

    python -m bench.gpu_trainer --json OUT      (on a machine with 2 CUDA GPUs)

The rollouts come from the deterministic transformers sampler of the trainer tests (this checks
the trainer's GPU path: device placement, bf16, NCCL, FSDP2 sharding, activation checkpointing,
the sharded checkpoint save), so the machine needs no vLLM. Reports per-step rewards and
gradient norms of both runs, step times, and the largest weight difference between the two
final checkpoints (bf16 reductions in another order: close, not equal).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from bench.common import ROOT
from protocol.weights_dir import step_dir_name


def config(run_dir: Path, model: Path, steps: int):
    from trainer_svc.config import Config

    return msgspec.convert(
        {
            "run": {"dir": str(run_dir), "seed": 3, "cpu_threads": 0},
            "model": {"path": str(model), "dtype": "bfloat16", "activation_checkpointing": True},
            "data": {"arithmetic_low": 0, "arithmetic_high": 9, "held_out": 10},
            "rollout": {"prompts_per_step": 8, "samples_per_prompt": 8, "max_tokens": 4, "spawn": False},
            "train": {"steps": steps, "lr": 1e-4, "grad_accum": 2},
            "checkpoint": {"every": 1, "keep_last": 1},
        },
        Config,
    )


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="the CPU check: a tiny model, a step, two CPU ranks (gloo)")
    args = parser.parse_args()
    if args.tiny:
        args.steps = 1
    import torch
    from safetensors.torch import load_file

    from rollout_svc.tiny_model import build
    from tests.trainer.local_sampler import TorchSampler  # the trainer tests' deterministic sampler
    from trainer_svc.run.loop import train

    root = Path(tempfile.mkdtemp(prefix="gpu-trainer-"))
    model = build(root / "model", hidden=64, layers=1) if args.tiny else build(root / "model", hidden=256, layers=4)
    one = config(root / "one-gpu", model, args.steps)
    started = time.monotonic()
    assert train(one, make_sampler=lambda cfg, launch_id: TorchSampler(cfg)) == 0
    one_s = time.monotonic() - started

    two = config(root / "two-gpus", model, args.steps)
    (root / "two.json").write_bytes(msgspec.json.encode(two))
    started = time.monotonic()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "tests" / "trainer" / "fsdp_run.py"),
            str(root / "two.json"),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    two_s = time.monotonic() - started
    if run.returncode:
        print(run.stdout[-4000:], run.stderr[-4000:])
        raise SystemExit(run.returncode)
    final = step_dir_name(args.steps)
    a = load_file(root / "one-gpu" / "checkpoints" / final / "model.safetensors")
    b = load_file(root / "two-gpus" / "checkpoints" / final / "model.safetensors")
    m1, m2 = metrics(root / "one-gpu"), metrics(root / "two-gpus")
    figures = {
        "gpus": torch.cuda.device_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "steps": args.steps,
        "one_gpu_wall_s": round(one_s, 1),
        "two_gpus_wall_s": round(two_s, 1),
        "rewards_one": [r["reward_mean"] for r in m1],
        "rewards_two": [r["reward_mean"] for r in m2],
        "grad_norm_one": [round(r["grad_norm"], 4) for r in m1],
        "grad_norm_two": [round(r["grad_norm"], 4) for r in m2],
        "median_train_s_one": sorted(r["train_s"] for r in m1)[len(m1) // 2],
        "median_train_s_two": sorted(r["train_s"] for r in m2)[len(m2) // 2],
        "max_weight_diff": max(float((a[k].float() - b[k].float()).abs().max()) for k in a),
        "dtype_saved": str(next(iter(a.values())).dtype),
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
