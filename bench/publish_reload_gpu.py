"""The weight sync on a GPU host, as a training step pays it: the trainer publishes its weights
(trainer_svc.weights.sync's writer: bf16 from the GPU, one directory per step) and a vLLM engine
(rollout_svc's VllmEngine, what the worker runs) reloads them in place and verifies them.

    python -m bench.publish_reload_gpu [--shape 1.5b] [--media /dev/shm,build] [--steps 5]
                                       [--writer-threads 4,8] [--json OUT]

A Qwen2.5-shaped model, random-initialised on the GPU (no download), plays the trainer's policy;
each step nudges every parameter in place, publishes into the medium, and has the engine load
that directory (inspect, reload_weights, reset the prefix cache, verify the live tensors against
the files). Reported per medium (and per count of writer threads, each step publishing once with
each, side by side): the medians of publish, reload and their sum. Target on tmpfs at the 1.5B
shape: publish + reload < 1.5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, gpu_name, say
from bench.engines import make_engine
from bench.models import QWEN_SHAPES, QWEN_TINY, qwen_config
from protocol.weights_dir import step_dir_name

TARGET_S = 1.5
SHAPES = {**QWEN_SHAPES, "tiny": QWEN_TINY}  # tiny: the CPU check of the script (--tiny)


def base_model(root: Path, shape: str, device: str = "cuda") -> tuple[Path, object]:
    """A directory with the config and tokenizer (what a publish copies), and the model on `device`."""
    import torch
    from transformers import Qwen2ForCausalLM

    from bench.models import QWEN_VOCAB
    from rollout_svc.tiny_model import write_tokenizer

    config = qwen_config(SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    base = root / f"{shape}-base"
    base.mkdir()
    config.save_pretrained(base)
    write_tokenizer(base, max_positions=2048, vocab_size=QWEN_VOCAB)
    return base, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--media", default="/dev/shm,build", help="comma-separated directories to publish into")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--writer-threads", default="", help="comma-separated thread counts (default: the writer's)")
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="the CPU check: the tiny shape, no engine, one step")
    args = parser.parse_args()
    device = "cuda"
    if args.tiny:
        args.shape, args.media, args.steps, device = "tiny", tempfile.gettempdir(), 1, "cpu"

    import torch

    from rollout_svc.weights import WeightsPolicy
    from trainer_svc.distributed import Distributed
    from trainer_svc.weights.publish import publish
    from trainer_svc.weights.streaming import use_writer_threads, writer_threads
    from trainer_svc.weights.writer import iter_full_tensors

    work = Path(tempfile.mkdtemp(prefix="bench-publish-"))
    base, model = base_model(work, args.shape, device)
    dist_info = Distributed(0, 1, torch.device(device, 0) if device == "cuda" else torch.device(device))
    figures = {}
    try:
        for medium in args.media.split(","):
            parent = Path(medium) if medium.startswith("/") else ROOT / medium
            parent.mkdir(parents=True, exist_ok=True)
            publish_dir = Path(tempfile.mkdtemp(prefix="bench-publish-", dir=parent))
            engine = make_engine(
                args.tiny,
                policy=WeightsPolicy([str(publish_dir)]),
                device="cuda:0",
                dtype="bfloat16",
                max_model_len=2048,
                gpu_memory_utilization=0.4,
            )
            say(f"{medium}: first publish and engine build")
            first = publish(
                0,
                iter_full_tensors(model, dist_info),
                publish_dir=publish_dir,
                base_model=base,
                dist_info=dist_info,
                dtype=torch.bfloat16,
            )
            build_s = engine.ensure_weights(str(first.path), first.content_id)
            gigabytes = first.bytes / 1e9
            counts = [int(c) for c in args.writer_threads.split(",") if c] or [None]
            publishes = {count: [] for count in counts}
            reloads = {count: [] for count in counts}
            published = 0
            for step in range(1, args.steps + 1):
                for count in counts:  # side by side: each step publishes once with each count
                    use_writer_threads(count)
                    published += 1
                    with torch.no_grad():
                        for p in model.parameters():
                            p.mul_(1.0 + 1e-3 * step)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    started = time.monotonic()
                    record = publish(
                        published,
                        iter_full_tensors(model, dist_info),
                        publish_dir=publish_dir,
                        base_model=base,
                        dist_info=dist_info,
                        dtype=torch.bfloat16,
                    )
                    publishes[count].append(time.monotonic() - started)
                    started = time.monotonic()
                    engine.ensure_weights(str(record.path), record.content_id)
                    reloads[count].append(time.monotonic() - started)
                    shutil.rmtree(publish_dir / step_dir_name(published - 1), ignore_errors=True)
                    say(
                        f"{medium} step {step}, {writer_threads()} writer threads, "
                        f"{len(list(record.path.glob('*.safetensors')))} shards: "
                        f"publish {publishes[count][-1]:.3f} s, reload {reloads[count][-1]:.3f} s"
                    )
            engine.close()
            shutil.rmtree(publish_dir, ignore_errors=True)
            for count in counts:
                use_writer_threads(count)
                p, r = statistics.median(publishes[count]), statistics.median(reloads[count])
                figures[f"{medium}, {writer_threads()} writer threads"] = {
                    "gigabytes": round(gigabytes, 3),
                    "engine_build_s": round(build_s, 1),
                    "publish_s_median": round(p, 3),
                    "publish_gb_per_s": round(gigabytes / p, 2),
                    "reload_s_median": round(r, 3),
                    "publish_plus_reload_s": round(p + r, 3),
                    "publish_s": [round(x, 3) for x in publishes[count]],
                    "reload_s": [round(x, 3) for x in reloads[count]],
                }
            use_writer_threads(None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data = {
        "benchmark": "publish_reload_gpu",
        "shape": args.shape,
        "gpu": gpu_name(),
        "target_s": TARGET_S,
        "date": time.strftime("%Y-%m-%d"),
        "cores": os.cpu_count(),
        "figures": figures,
    }
    print("| medium | GB | publish s (GB/s) | reload s | publish + reload s |")
    print("| --- | --- | --- | --- | --- |")
    for medium, f in figures.items():
        print(
            f"| {medium} | {f['gigabytes']} | {f['publish_s_median']} ({f['publish_gb_per_s']}) | "
            f"{f['reload_s_median']} | {f['publish_plus_reload_s']} |"
        )
    print(json.dumps(data))
    if args.json:
        Path(args.json).write_text(json.dumps(data) + "\n")


if __name__ == "__main__":
    main()
