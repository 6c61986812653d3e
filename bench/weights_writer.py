"""Publishing weights: trainer_svc.weights.writer against save_pretrained and the medium's raw speed.

    .venvs/trainer/bin/python -m bench.weights_writer [--shapes tiny,llama-100m] [--media DISK_DIR,/dev/shm]
                                                      [--repeats 5] [--json OUT]
    python -m bench.weights_writer --shapes qwen2.5-0.5b,qwen2.5-1.5b     (on a GPU host: CUDA tensors, bf16)

For each model shape (random-initialised, built here, nothing downloaded) and each medium, in one
run, repeats interleaved so that all figures share the same minutes of a shared machine:

- raw: the medium's write bandwidth. Disk: `dd if=/dev/zero bs=64M oflag=direct conv=fsync`;
  tmpfs (no O_DIRECT there): the same dd, buffered: a large copy into memory.
- writer: write_weights_dir from the model's own tensors (iter_full_tensors), in the serving dtype
  (bf16 from CUDA tensors, the model's dtype on CPU), crc32c checksums on; again without checksums,
  which shows what the checksum costs.
- save_pretrained(safe_serialization=True) of the same model, then an fsync of each file it wrote
  (what the writer's durability costs it).

Every write goes into a fresh directory on the medium, removed afterwards. GB/s is 10^9 bytes of
weights per second; "of raw" is the writer's speed over the medium's. Prints a markdown table and
the JSON of every measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# name: (architecture, config); tiny is build/tiny-model's shape (rollout_svc/tiny_model.py)
SHAPES = {
    "tiny": (
        "llama",
        dict(
            vocab_size=128,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=64,
            tie_word_embeddings=False,
        ),
    ),
    "llama-100m": (
        "llama",
        dict(
            vocab_size=32000,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=8,
            num_attention_heads=12,
            num_key_value_heads=12,
            head_dim=64,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2.5-0.5b": (
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
            rope_theta=1e6,
        ),
    ),
    "qwen2.5-1.5b": (
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
            rope_theta=1e6,
        ),
    ),
}


def build(shape: str, device: torch.device, dtype: torch.dtype, base_dir: Path):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    arch, kwargs = SHAPES[shape]
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(config_cls(**kwargs)).to(dtype)
    model.config.save_pretrained(base_dir)  # what the writer copies beside the weights
    return model


def raw_bandwidth(directory: Path, nbytes: int, tmpfs: bool, block: int = 2**26, least: int = 8) -> float:
    """Bytes per second dd writes, for nbytes rounded up to blocks of `block` bytes (at least `least`
    of them: 512 MiB by default)."""
    count = max(least, -(-nbytes // block))
    target = directory / "dd.raw"
    cmd = ["dd", "if=/dev/zero", f"of={target}", f"bs={block}", f"count={count}", "conv=fsync"]
    if not tmpfs:
        cmd.append("oflag=direct")
    try:
        started = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        seconds = time.perf_counter() - started
    finally:
        target.unlink(missing_ok=True)
    return count * block / seconds


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def write(model, dist_info, base_dir: Path, step: int, checksums: bool, out: Path) -> None:
    from trainer_svc.weights.writer import iter_full_tensors, write_weights_dir

    stream = iter_full_tensors(model, dist_info)
    write_weights_dir(out, stream, base_model=base_dir, step=step, content_id=f"bench-{step}", checksums=checksums)


def save_pretrained(model, out: Path) -> None:
    from protocol.fsio import fsync_tree

    model.save_pretrained(out, safe_serialization=True)
    fsync_tree(out)


def weight_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def measure(model, base_dir: Path, medium: Path, tmpfs: bool, repeats: int, dist_info, tiny: bool = False) -> dict:
    runs: dict[str, list[float]] = {"raw": [], "writer": [], "writer_no_crc": [], "save_pretrained": []}
    nbytes = 0
    for repeat in range(repeats):
        variants = {  # each writes the same weights into a directory of its own
            "writer": partial(write, model, dist_info, base_dir, repeat, True),
            "writer_no_crc": partial(write, model, dist_info, base_dir, repeat, False),
            "save_pretrained": partial(save_pretrained, model),
        }
        work = Path(tempfile.mkdtemp(prefix="bench-ww-", dir=medium))
        try:
            for key, write_into in variants.items():
                out = work / key
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                seconds = timed(partial(write_into, out))
                written = weight_bytes(out)
                runs[key].append(written / seconds)
                if key == "writer":  # its size is the one the raw write and the table use
                    nbytes = written
                shutil.rmtree(out)
            raw = {"block": 2**20, "least": 1} if tiny else {}  # the check writes megabytes, not 512 MiB
            runs["raw"].append(raw_bandwidth(work, nbytes, tmpfs, **raw))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    result = {"bytes": nbytes}
    for key, rates in runs.items():
        median = statistics.median(rates)
        result[key] = {
            "gb_s": round(median / 1e9, 3),
            "seconds": round(nbytes / median, 4),
            "runs_gb_s": [round(r / 1e9, 3) for r in rates],
        }
    result["writer_of_raw"] = round(result["writer"]["gb_s"] / result["raw"]["gb_s"], 3)
    result["writer_over_save_pretrained"] = round(result["writer"]["gb_s"] / result["save_pretrained"]["gb_s"], 2)
    return result


def machine(device: torch.device) -> dict:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    mem = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    info = {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(mem / 2**20, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_start": os.getloadavg()[0],
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def filesystem(path: Path) -> str:
    out = subprocess.run(["df", "--output=fstype", str(path)], capture_output=True, text=True).stdout.split()
    return out[-1] if out else "?"


def table(results: list[dict]) -> str:
    lines = [
        "| model | params | medium | raw | writer | writer, no checksum | save_pretrained + fsync | writer / raw "
        "| writer / save_pretrained |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def cell(r, key):
        return f"{r[key]['seconds']:.3f} s, {r[key]['gb_s']:.2f} GB/s"

    for r in results:
        lines.append(
            f"| {r['shape']} ({r['dtype']}) | {r['params'] / 1e6:.1f}M | {r['medium']} ({r['fs']}) "
            f"| {r['raw']['gb_s']:.2f} GB/s | {cell(r, 'writer')} | {cell(r, 'writer_no_crc')} "
            f"| {cell(r, 'save_pretrained')} | {100 * r['writer_of_raw']:.0f}% "
            f"| {r['writer_over_save_pretrained']:.1f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tiny,llama-100m", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument(
        "--media",
        default=f"{ROOT / 'build'},/dev/shm",
        help="comma-separated directories; one on tmpfs is measured as memory",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument(
        "--tiny", action="store_true", help="a check of the script: the tiny shape, once, in a temp dir"
    )
    args = parser.parse_args()
    if args.tiny:
        args.shapes, args.media, args.repeats = "tiny", tempfile.mkdtemp(prefix="bench-ww-medium-"), 1

    from trainer_svc.distributed import Distributed

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the serving dtype; CPU: the model's
    dist_info = Distributed(0, 1, device)
    info = machine(device)
    results = []
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        base_dir = Path(tempfile.mkdtemp(prefix=f"bench-ww-{shape}-"))
        model = build(shape, device, dtype, base_dir)
        params = sum(t.numel() for t in model.state_dict().values()) - (
            model.lm_head.weight.numel() if model.config.tie_word_embeddings else 0
        )
        for medium in args.media.split(","):
            medium_path = Path(medium)
            medium_path.mkdir(parents=True, exist_ok=True)
            fs = filesystem(medium_path)
            result = measure(model, base_dir, medium_path, fs == "tmpfs", args.repeats, dist_info, args.tiny)
            results.append(
                {
                    "shape": shape,
                    "params": params,
                    "dtype": str(dtype).removeprefix("torch."),
                    "device": device.type,
                    "medium": medium,
                    "fs": fs,
                    **result,
                }
            )
            print(json.dumps(results[-1]), flush=True)
        del model
        shutil.rmtree(base_dir)
    info["loadavg_end"] = os.getloadavg()[0]
    report = {
        "benchmark": "weights_writer",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": info,
        "repeats": args.repeats,
        "results": results,
    }
    print()
    print(table(results))
    print()
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
