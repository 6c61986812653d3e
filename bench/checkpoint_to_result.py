"""From a checkpoint directory appearing to the first result generated with its weights.

    .venvs/rollout/bin/python -m bench.checkpoint_to_result [--hidden 128 --layers 2] [--checkpoints 6] [--json OUT]

A worker serves model A. Then, as a trainer does, each round writes a new checkpoint (weights
perturbed, safetensors in a temporary sibling, renamed into place), submits one request naming
it (4 prompts x 4 samples x 16 tokens) and waits for the result. The time runs from the
rename to the producer holding the result: spool round trip, directory checks, in-place
reload, verification and generation. The result's own timings give the split.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import report
from bench.models import build_models, parameter_count
from bench.workers import serving, start_worker, stop, wait_until
from protocol.weights_dir import step_dir_name


def write_checkpoint(base: Path, out: Path, step: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    staging = out.with_name(f".{out.name}.tmp")
    shutil.copytree(base, staging, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(base / "model.safetensors")
    generator = torch.Generator().manual_seed(step)
    tensors = {k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in tensors.items()}
    save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
    os.rename(staging, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--checkpoints", type=int, default=6)
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: 2 checkpoints, an echo worker")
    args = parser.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.checkpoints = 64, 1, 2

    from protocol.client import SpoolClient
    from protocol.messages import Request
    from protocol.spool import Spool

    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    base = build_models(root, ["a"], hidden=args.hidden, layers=args.layers)["a"]
    spool = Spool(root / "spool", create=True)
    engine = ["--engine", "echo"] if args.tiny else ["--engine", "vllm", "--weights", str(base)]
    proc = start_worker(spool, "bench-ckpt", [*engine, "--allowed-root", str(root), "--idle-exit", "0"], root)
    rounds = []
    try:
        wait_until(spool, "bench-ckpt", serving)
        with SpoolClient(spool.root) as client:
            warm = Request(
                request_id="warm-up",
                weights_dir=str(base),
                prompts=["1+1="],
                n_samples_per_prompt=4,
                max_tokens=16,
                temperature=1.0,
            )
            client.submit(warm)
            client.wait([warm.request_id], timeout_s=600)
            for step in range(1, args.checkpoints + 1):
                checkpoint = root / "checkpoints" / step_dir_name(step)
                checkpoint.parent.mkdir(exist_ok=True)
                write_checkpoint(base, checkpoint, step)
                appeared = time.perf_counter()
                request = Request(
                    request_id=f"after-{step}",
                    weights_dir=str(checkpoint),
                    prompts=["1+1=", "2+3=", "7+8=", "9+9="],
                    n_samples_per_prompt=4,
                    max_tokens=16,
                    temperature=1.0,
                )
                client.submit(request)
                result = client.wait([request.request_id], timeout_s=600)[request.request_id]
                assert result.ok and result.weights_dir == str(checkpoint), result.error
                rounds.append(
                    {
                        "total_s": time.perf_counter() - appeared,
                        "reload_s": result.timings.reload_s,
                        "generate_s": result.timings.generate_s,
                        "queued_s": result.timings.queued_s,
                    }
                )
    finally:
        stop(proc)
    median = {key: round(statistics.median(r[key] for r in rounds), 4) for key in rounds[0]}
    report(
        "checkpoint_to_result",
        {
            "parameters": parameter_count(base),
            "checkpoints": len(rounds),
            "median": median,
            "max_total_s": round(max(r["total_s"] for r in rounds), 4),
        },
        args.json,
    )


if __name__ == "__main__":
    main()
