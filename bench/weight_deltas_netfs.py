"""Delta publishes against full ones over sshfs: the trainer publishing on one mount, a worker
loading on another (two hosts' views of one export), SmolLM2-135M in bfloat16.

    PYTHONPATH=protocol/src:rollout_svc/src:trainer_svc/src \
        .venvs/trainer/bin/python -m bench.weight_deltas_netfs [--steps 8] [--fraction 0.02] [--json OUT]

(both services' code on the path: the trainer's publisher and the worker's loader run here side by
side; each venv holds its own service only.)

The mounts are the tests' (tests/netfs.py): an sshd of its own on a loopback port, sshfs with the
caches on. Each step flips the lowest mantissa bit of `--fraction` of the elements (the changed
fraction a real run measures: bench/weight_deltas.py), then, side by side:

- full: trainer_svc.weights.publish.publish of the step into the trainer's mount; the worker reads the
  directory's shards from its own mount (what an in-place reload reads);
- delta: trainer_svc.weights.deltas.DeltaWriter (an anchor first, then deltas) into the
  trainer's mount; the worker's loader (rollout_svc.delta_load) reads the delta from its mount,
  applies it to the copy it holds and writes the rebuilt weights to its tmpfs, then reads them
  from there (what the engine's reload of the rebuilt directory reads).

The engine's own load from those files (vLLM's load_weights) is the same in both and left out.
Loopback has no network latency or bandwidth limit beyond sftp's: over a real network the full
path's bytes cost more. Needs /dev/fuse, sshfs, sshd.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from bench.common import ROOT
from bench.models import build_models
from protocol.watch import filesystem_type
from rollout_svc.delta_load import DeltaLoader
from rollout_svc.weight_forms import DeltaWeights, resolve
from rollout_svc.weights import WeightsPolicy
from tests.netfs import DIR_CACHE_S, SshServer, missing_prerequisites, sshfs_mount  # the tests' mount helpers
from trainer_svc.weights.deltas import DeltaWriter
from trainer_svc.weights.publish import publish

MODEL = ROOT / "build" / "smollm2-135m-instruct"


def flip(tensors: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy with the lowest bit of about `fraction` of the elements flipped (one ulp)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        bits = t.view(torch.int16).clone()
        mask = torch.rand(bits.shape, generator=g) < fraction
        bits[mask] ^= 1
        out[name] = bits.view(torch.bfloat16)
    return out


def read_shards(directory: Path) -> int:
    """Read every shard's bytes (what a reload reads; safetensors' load_file maps the file and
    would read only what is touched)."""
    total = 0
    for shard in sorted(directory.glob("*.safetensors")):
        with open(shard, "rb", buffering=0) as f:
            while chunk := f.read(64 * 2**20):
                total += len(chunk)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fraction", type=float, default=0.02)
    parser.add_argument("--anchor-every", type=int, default=8)
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: a tiny model, 2 steps")
    args = parser.parse_args()
    missing = missing_prerequisites("sshfs")
    if missing:
        sys.exit(f"missing: {', '.join(missing)} (apt-get install sshfs openssh-server)")
    if args.tiny:
        args.steps, args.fraction = 2, 0.05
        args.model = build_models(Path(tempfile.mkdtemp(prefix="deltas-netfs-model-")), ["m"], hidden=64, layers=1)["m"]
    if not (args.model / "config.json").is_file():
        sys.exit(f"{args.model} is missing: run `make real-model`")
    torch.set_num_threads(2)
    tensors = {}
    for shard in sorted(args.model.glob("*.safetensors")):
        tensors.update({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(shard)).items()})
    full_bytes = sum(t.numel() * 2 for t in tensors.values())
    base = Path(tempfile.mkdtemp(prefix="deltas-netfs-"))
    server = SshServer(base / "sshd").start()
    export = base / "export"
    export.mkdir()
    rows = []
    try:
        with (
            sshfs_mount(server, export, base / "trainer") as trainer,
            sshfs_mount(server, export, base / "worker") as worker,
        ):
            publisher = DeltaWriter(args.anchor_every)
            loader = DeltaLoader(WeightsPolicy())
            for step in range(1, args.steps + 1):
                tensors = flip(tensors, args.fraction, seed=step) if step > 1 else tensors
                row = {"step": step}
                started = time.perf_counter()
                record = publish(
                    step, tensors, publish_dir=trainer / "full", base_model=args.model, dtype=torch.bfloat16
                )
                published = time.perf_counter()
                read_shards(worker / "full" / record.path.name)
                row |= {"full_publish_s": published - started, "full_load_s": time.perf_counter() - published}
                started = time.perf_counter()
                record = publisher.publish(
                    step, tensors, publish_dir=trainer / "delta", base_model=args.model, dtype=torch.bfloat16
                )
                if args.tiny and step > 1:  # a tiny step outruns the worker mount's listing cache; a real one does not
                    time.sleep(2 * DIR_CACHE_S + 0.1)
                published = time.perf_counter()
                form = resolve(loader.policy, str(worker / "delta" / record.path.name))  # an anchor at first
                weights = loader.weights(form) if isinstance(form, DeltaWeights) else form.weights
                rebuilt = time.perf_counter()
                read_shards(Path(weights.real_path))
                row |= {
                    "kind": publisher.last.kind,
                    "delta_publish_s": published - started,
                    "delta_rebuild_s": rebuilt - published,
                    "delta_load_s": time.perf_counter() - published,
                    "delta_bytes_written": record.bytes,
                    "changed_fraction": publisher.last.changed_fraction,
                    # where the delta publish went: host copies, diff, the directory (encode included)
                    "delta_copy_s": publisher.last.copy_s,
                    "delta_diff_s": publisher.last.diff_s,
                    "delta_write_s": publisher.last.write_s,
                }
                rows.append({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
                print(json.dumps(rows[-1]), flush=True)
            loader.close()
    finally:
        server.stop()
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    deltas = [r for r in rows if r["kind"] == "delta"]

    def median(key, among):
        return round(statistics.median(r[key] for r in among), 4) if among else None

    full_s = median("full_publish_s", rows) + median("full_load_s", rows)
    delta_s = (median("delta_publish_s", deltas) or 0) + (median("delta_load_s", deltas) or 0)
    figures = {
        "command": " ".join(["python -m bench.weight_deltas_netfs", *sys.argv[1:]]),
        "machine": f"{platform.node()}: {os.cpu_count()} cores; sshfs over loopback ({filesystem_type(base)} below)",
        "model": str(args.model.name),
        "full_bytes": full_bytes,
        "fraction": args.fraction,
        "delta_bytes_median": median("delta_bytes_written", deltas),
        "full_publish_s_median": median("full_publish_s", rows),
        "full_load_s_median": median("full_load_s", rows),
        "delta_publish_s_median": median("delta_publish_s", deltas),
        "delta_rebuild_s_median": median("delta_rebuild_s", deltas),
        "delta_load_s_median": median("delta_load_s", deltas),
        "full_publish_plus_load_s": round(full_s, 4),
        "delta_publish_plus_load_s": round(delta_s, 4),
        "speedup": round(full_s / delta_s, 2) if delta_s else None,
        "per_step": rows,
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
