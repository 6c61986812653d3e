"""The weight sync both ways, side by side: a weights directory (publish + the engine's in-place
reload) against a shared-memory slot (slot publish + the engine's slot load), with one engine,
each step doing both, in turn.

    PYTHONPATH=protocol/src:rollout_svc/src:trainer_svc/src \\
        .venvs/rollout/bin/python -m bench.publish_reload_slots [--device cpu|cuda] [--shapes tiny,mid]
                                                                [--steps 8] [--shm /dev/shm] [--json OUT]

Shapes: `tiny` (build/tiny-model's, 0.46M parameters), `mid` (the same Llama at hidden 768, 12
layers: 85M parameters, 340 MB in float32), `0.5b` and `1.5b` (Qwen2.5's, GPU only), or NAME=DIR:
a real model's directory (one model.safetensors), e.g. `smollm2=build/smollm2-135m-instruct`.
`--eager` builds the engine without CUDA graphs or torch.compile: it starts sooner, and neither
touches a weight load. The policy
is the model's tensors, on the device, nudged in place each step (float32 on CPU, bfloat16 on a
GPU, the dtypes the trainer publishes). Each step: publish a directory into --shm and have the
engine load it (inspect, reload in place, verify), then publish a slot into a ring in --shm and
have the engine load that (lease, one copy, checksum, load_weights, verify). Reported per shape:
the medians of publish, load and their sum for each path (the ring's first lap, each slot's first
write, pays the page faults that populate its memory: a few steps more than two make it the
steady state's figure).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import borrow_from_trainer_venv, report, say
from bench.engines import make_engine

borrow_from_trainer_venv("crc32c")  # the trainer's writers need it; only the trainer's venv holds it

SHAPES = {"tiny": dict(hidden=128, layers=2), "mid": dict(hidden=768, layers=12)}


def base_model(root: Path, shape: str, device: str) -> Path:
    if "=" in shape:  # a real model, used as it is: its tensors are the policy's start
        return Path(shape.partition("=")[2]).resolve()
    if shape in SHAPES:
        from rollout_svc.tiny_model import build

        hidden, layers = SHAPES[shape]["hidden"], SHAPES[shape]["layers"]
        return build(root / shape, seed=0, hidden=hidden, layers=layers, intermediate=3 * hidden, init_std=0.3)
    if device == "cpu":
        raise SystemExit(f"shape {shape} is for a GPU; on a CPU use {', '.join(SHAPES)}")
    from bench.publish_reload_gpu import base_model as qwen_base

    base, model = qwen_base(root, shape)
    from safetensors.torch import save_file

    tied = {"lm_head.weight"}  # tied to the embedding: save_pretrained leaves it out too
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}, base / "model.safetensors")
    return base


def measure(shape: str, device: str, steps: int, shm: Path, eager: bool | None, tiny: bool = False) -> dict:
    import torch
    from safetensors.torch import load_file

    from rollout_svc.weights import WeightsPolicy
    from trainer_svc.weights.publish import publish
    from trainer_svc.weights.slots import SlotRing
    from trainer_svc.weights.writer import as_stream

    work = Path(tempfile.mkdtemp(prefix="bench-slots-", dir=shm))
    try:
        base = base_model(work, shape, device)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        tensors = {k: v.to(device=device, dtype=dtype) for k, v in load_file(base / "model.safetensors").items()}
        gigabytes = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9
        engine = make_engine(
            tiny,
            policy=WeightsPolicy([str(work), str(base.parent)]),
            device=device,
            dtype="bfloat16" if device.startswith("cuda") else "float32",
            max_model_len=256,
            gpu_memory_utilization=0.4,
            enforce_eager=eager,
        )
        ring = SlotRing(work / "ring", 2, spool_dir=None, wait_s=10)
        say(f"{shape}: {gigabytes:.3f} GB; building the engine")
        built = time.monotonic()
        engine.ensure_weights(str(base))
        say(f"{shape}: engine built in {time.monotonic() - built:.1f} s")
        times = {key: [] for key in ("dir_publish", "dir_load", "slot_publish", "slot_load")}
        for step in range(1, steps + 1):
            with torch.no_grad():
                for t in tensors.values():
                    t.mul_(1.0 + 1e-3)
            sync(device)
            started = time.monotonic()
            record = publish(step, tensors, publish_dir=work / "weights", base_model=base, dtype=dtype)
            times["dir_publish"].append(time.monotonic() - started)
            started = time.monotonic()
            engine.ensure_weights(str(record.path), record.content_id)
            times["dir_load"].append(time.monotonic() - started)
            shutil.rmtree(record.path)
            started = time.monotonic()
            slot = ring.choose()
            written = ring.write(slot, step, f"bench-{step}", as_stream(tensors), dtype, base)
            times["slot_publish"].append(time.monotonic() - started)
            started = time.monotonic()
            engine.ensure_weights(str(written.path), written.content_id)
            times["slot_load"].append(time.monotonic() - started)
            say(f"{shape} step {step}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()))
        engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {key: statistics.median(values) for key, values in times.items()}
    return {
        "gigabytes": round(gigabytes, 3),
        **{f"{key}_s_median": round(value, 4) for key, value in med.items()},
        "dir_total_s": round(med["dir_publish"] + med["dir_load"], 4),
        "slot_total_s": round(med["slot_publish"] + med["slot_load"], 4),
        "all_s": {key: [round(x, 4) for x in values] for key, values in times.items()},
    }


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shapes", default="tiny,mid")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--shm", default="/dev/shm", help="the tmpfs both paths publish into")
    parser.add_argument("--eager", action="store_true", help="build the engine eager (GPU: it starts sooner)")
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: no engine (loads read the files)")
    args = parser.parse_args()
    if args.tiny:
        args.device, args.shapes, args.steps, args.shm = "cpu", "tiny", 3, tempfile.gettempdir()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("rollout_svc").setLevel(logging.INFO)  # the engine's own account of each load
    device = "cuda:0" if args.device == "cuda" else "cpu"
    if device == "cpu":
        import torch

        torch.set_num_threads(1)  # the trainer's own setting on CPU (run.cpu_threads): the engine has the cores
    eager = True if args.eager else None  # None: the engine's default for the device
    figures = {
        shape.partition("=")[0]: measure(shape, device, args.steps, Path(args.shm), eager, args.tiny)
        for shape in args.shapes.split(",")
    }
    print("| shape | GB | directory: publish + load s | slot: publish + load s |")
    print("| --- | --- | --- | --- |")
    for shape, f in figures.items():
        print(
            f"| {shape} | {f['gigabytes']} | {f['dir_publish_s_median']} + {f['dir_load_s_median']} = "
            f"{f['dir_total_s']} | {f['slot_publish_s_median']} + {f['slot_load_s_median']} = {f['slot_total_s']} |"
        )
    report("publish_reload_slots", {"device": args.device, "shm": args.shm, **figures}, args.json)


if __name__ == "__main__":
    main()
