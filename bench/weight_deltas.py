"""Sparse weight deltas on real training: how much of the weights changes per step, and what a
delta costs to encode and to apply.

    .venvs/rollout/bin/python -m bench.weight_deltas [--steps 40] [--dtype float32|bfloat16]
        [--delta off|on] [--config configs/demo.toml] [--model runs/demo/sft-model] [--json OUT]

Runs `trainer-svc train` with the demo's config (configs/demo.toml: the tiny model, GRPO on CPU,
a spawned vLLM worker), or `--config`'s (configs/smollm2-gpu.toml: the real model on a GPU, its
model the config's unless `--model` names one), for `--steps` steps, publishing whole directories
(no slots), publishing every step and keeping every publish,
then reads the published steps back in order and, for each step after the first, reports: the
fraction of elements whose bits changed since the step before, the encoded delta's bytes against
the full weights', the seconds to diff and encode it, and to decode and apply it to the previous
step's weights (the rebuild is checked bit for bit against the step's own weights). With
`--delta on` the trainer publishes deltas itself (where they pay), and the rebuild reads them
through the worker's loader (rollout_svc.delta_load).

`--dtype` is the published dtype: the demo's float32 (the CPU engine's), or bfloat16 (what a
GPU run serves; the CPU engine loads bfloat16 files into its float32 weights). The model
defaults to the demo's warm-up output; `make demo` (or `trainer-svc sft configs/demo.toml`)
writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tomllib

from bench import synthetic
from bench.common import ROOT, VENVS, borrow_from_trainer_venv, sources_first
from bench.models import build_models
from protocol import weight_delta, weights_chain
from protocol.weights_dir import read_manifest
from tests.run_config import ROLLOUT_VENV, merge, write_run_config  # the tests' trainer configs

TRAINER_VENV = VENVS / "trainer"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--delta", choices=("off", "on"), default="off")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.toml")
    parser.add_argument("--model", type=Path, help="default: the demo's warm-up output, or the config's model")
    parser.add_argument("--json")
    parser.add_argument(
        "--tiny", action="store_true", help="a check of the script: no launch, a tiny model's publishes"
    )
    args = parser.parse_args()
    args.settings = tomllib.loads(args.config.read_text())
    if args.tiny:
        args.steps, args.model = 3, args.model or Path("tiny-model")  # built in train(): no launch reads it
    elif args.model is None:
        demo = args.config.resolve() == (ROOT / "configs" / "demo.toml").resolve()
        args.model = ROOT / "runs" / "demo" / "sft-model" if demo else ROOT / args.settings["model"]["path"]
    if not (args.tiny or (args.model / "config.json").is_file()):
        sys.exit(f"{args.model} is missing: run `make demo` (or `trainer-svc sft configs/demo.toml`) first")
    work = Path(tempfile.mkdtemp(prefix="weight-deltas-"))
    try:
        wall = train(work, args)
        figures = measure(work / "run" / "weights", args)
        figures["train_wall_s"] = round(wall, 1)
        worker_log = (work / "run" / "rollout-worker.log").read_text(errors="replace")
        figures["worker_rebuilds"] = worker_log.count("rollout_svc.delta_load: rebuilt ")
        figures["worker_rebuild_lines"] = [line for line in worker_log.splitlines() if "delta_load: rebuilt" in line][
            :3
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


def train(work: Path, args) -> float:
    settings = dict(args.settings)
    settings.pop("sft", None)
    if settings.get("data", {}).get("path"):  # relative to the checkout, as the config's comment says
        settings["data"] = settings["data"] | {"path": str(ROOT / settings["data"]["path"])}
    config = write_run_config(
        work / "run.toml",
        merge(
            settings,
            {
                "run": {"dir": str(work / "run")},
                "model": {"path": str(args.model.resolve())},
                "rollout": {"rollout_venv": ROLLOUT_VENV},
                "train": {"steps": args.steps},
                "publish": {
                    "every": 1,
                    "keep_last": args.steps + 1,
                    "dtype": args.dtype,
                    "delta": args.delta,
                    "delta_anchor_every": 1000,
                    "slots": "off",  # every step a directory, to diff
                },
                "checkpoint": {"every": 10**6},
                "canary": {"every": 0},
            },
        ),
    )
    env = sources_first(os.environ, "protocol", "rollout_svc", "trainer_svc")
    started = time.monotonic()
    if args.tiny:
        synthetic.stand_in_train(config)
        tiny_publishes(work / "run" / "weights", args.steps, args.dtype)
        return time.monotonic() - started
    with open(work / "train.log", "wb") as log:
        done = subprocess.run(
            [str(TRAINER_VENV / "bin" / "trainer-svc"), "train", str(config)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if done.returncode != 0:
        sys.exit(f"trainer-svc train failed ({done.returncode}):\n" + (work / "train.log").read_text()[-4000:])
    return time.monotonic() - started


def tiny_publishes(publish_dir: Path, steps: int, dtype: str) -> None:
    """--tiny: what publishing every step leaves, from a tiny model whose first column moves a step."""
    borrow_from_trainer_venv("crc32c")  # the trainer's writer, run here
    import torch
    from safetensors.torch import load_file

    from trainer_svc.weights.publish import publish

    base = build_models(publish_dir.parent / "models", ["base"], hidden=64, layers=1)["base"]
    tensors = load_file(base / "model.safetensors")
    for step in range(1, steps + 1):
        for tensor in tensors.values():
            tensor[..., :1] += 1e-2
        publish(step, tensors, publish_dir=publish_dir, base_model=base, dtype=getattr(torch, dtype))


def load_full(directory: Path) -> dict[str, np.ndarray]:
    """A full directory's tensors as bit patterns (numpy has no bfloat16: read raw)."""
    tensors = {}
    for shard in sorted(p for p in directory.iterdir() if p.suffix == ".safetensors"):
        tensors.update(_load_raw(shard))
    return tensors


def _load_raw(shard: Path) -> dict[str, np.ndarray]:
    data = shard.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    body = memoryview(data)[8 + length :]
    widths = {"F32": "<u4", "BF16": "<u2", "F16": "<u2"}
    return {
        name: np.frombuffer(body[slice(*spec["data_offsets"])], dtype=widths[spec["dtype"]]).reshape(spec["shape"])
        for name, spec in header.items()
    }


def measure(publish_dir: Path, args) -> dict:
    from rollout_svc.delta_load import DeltaLoader
    from rollout_svc.weight_forms import resolve
    from rollout_svc.weights import WeightsPolicy

    found = sorted(weights_chain.versions(publish_dir).values(), key=lambda v: v.step)
    loader = DeltaLoader(WeightsPolicy())
    rows = []
    previous = None
    for version in found:
        if version.delta_base is None:
            current = load_full(version.path)
        else:  # the trainer published a delta: rebuild it as the worker does
            weights = loader.weights(resolve(loader.policy, str(version.path)))
            current = load_full(Path(weights.real_path))
        if previous is not None:
            started = time.perf_counter()
            delta = weight_delta.diff_model(previous, current, base_id="a", content_id="b")
            data = weight_delta.encode(delta)
            encoded = time.perf_counter()
            rebuilt = {name: array.copy() for name, array in previous.items()}
            copied = time.perf_counter()
            weight_delta.apply_model(rebuilt, weight_delta.decode(data), held_id="a")
            applied = time.perf_counter()
            exact = all(np.array_equal(rebuilt[n], current[n]) for n in current)
            full_bytes = sum(a.nbytes for a in current.values())
            elements = sum(a.size for a in current.values())
            rows.append(
                {
                    "step": version.step,
                    "published": "delta" if version.delta_base else "full",
                    "changed_fraction": round(delta.changed / elements, 5),
                    "delta_bytes": len(data),
                    "full_bytes": full_bytes,
                    "delta_over_full": round(len(data) / full_bytes, 4),
                    "diff_encode_s": round(encoded - started, 4),
                    "decode_apply_s": round(applied - copied, 4),
                    "bit_exact": exact,
                }
            )
        previous = current
    loader.close()
    fractions = [r["changed_fraction"] for r in rows]
    ratios = [r["delta_over_full"] for r in rows]
    manifest = read_manifest(found[-1].path) if found else None
    return {
        "command": " ".join(["python -m bench.weight_deltas", *sys.argv[1:]]),
        "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "steps": len(found),
        "dtype": manifest.dtype if manifest else args.dtype,
        "published_deltas": sum(r["published"] == "delta" for r in rows),
        "elements": sum(a.size for a in previous.values()) if previous else 0,
        "full_bytes": rows[0]["full_bytes"] if rows else 0,
        "changed_fraction_median": statistics.median(fractions) if rows else None,
        "changed_fraction_min_max": [min(fractions), max(fractions)] if rows else None,
        "delta_over_full_median": statistics.median(ratios) if rows else None,
        "diff_encode_s_median": statistics.median(r["diff_encode_s"] for r in rows) if rows else None,
        "decode_apply_s_median": statistics.median(r["decode_apply_s"] for r in rows) if rows else None,
        "all_bit_exact": all(r["bit_exact"] for r in rows),
        "per_step": rows,
    }


if __name__ == "__main__":
    main()
