"""The weight sync of a LoRA adapter against the full model's, at two model sizes, with one engine:
each step publishes the full weights as a directory, then into a shared-memory slot, then a LoRA
adapter (rank --rank on the decoder's seven linear projections), and has the engine load each.

    PYTHONPATH=protocol/src:rollout_svc/src:trainer_svc/src \\
        .venvs/rollout/bin/python -m bench.lora_sync [--shapes tiny,mid] [--steps 6] [--rank 8] [--json OUT]

Shapes as bench/publish_reload_slots.py: `tiny` (build/tiny-model's Llama, 0.46M parameters) and
`mid` (the same Llama at hidden 768, 12 layers: 85M parameters, 340 MB in float32). One engine
(vLLM, CPU build) started with LoRA on serves all three paths; each load is what the worker
reports as a request's `reload_s` (the engine's generate of one token after it: the load plus
its check; for the adapter, the check of its manifest and files, the copy, and vLLM's add_lora).
The 1-token generation right after each load is reported too, against the same generation once
more with nothing to load: what a path leaves to the first engine step (for an adapter, vLLM
activates it in its LoRA slots there). Medians of --steps steps. The publishes are the trainer's
writers: trainer_svc.weights.publish (directory), trainer_svc.weights.slots (slot),
trainer_svc.weights.adapters (adapter).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import report, say
from bench.engines import make_engine
from bench.publish_reload_slots import base_model  # borrows crc32c from the trainer's venv too

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter_tensors(base: dict, rank: int) -> dict:
    """A LoRA adapter of every decoder projection of `base` (its tensors by name), PEFT's names."""
    import torch

    found = {}
    for name, weight in base.items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        out_features, in_features = weight.shape
        prefix = f"base_model.model.{module}"
        found[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features) / in_features**0.5
        found[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank) * 1e-3
    return found


def adapter_config(base: Path, rank: int) -> bytes:
    """adapter_config.json as PEFT writes it for such an adapter (the keys vLLM reads among them)."""
    config = {
        "base_model_name_or_path": str(base), "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "lora_alpha": 2 * rank, "lora_dropout": 0.0, "modules_to_save": None, "peft_type": "LORA", "r": rank,
        "target_modules": sorted(PROJECTIONS), "task_type": None, "use_dora": False, "use_rslora": False,
    }  # fmt: skip
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def measure(shape: str, steps: int, rank: int, shm: Path, tiny: bool = False) -> dict:
    import torch
    from safetensors.torch import load_file

    from protocol.messages import Request
    from protocol.weights_dir import Adapter, weights_content_id
    from rollout_svc.weights import WeightsPolicy
    from trainer_svc.weights.adapters import write_adapter_dir
    from trainer_svc.weights.publish import publish, published_dir
    from trainer_svc.weights.slots import SlotRing
    from trainer_svc.weights.writer import as_stream

    work = Path(tempfile.mkdtemp(prefix="bench-lora-sync-", dir=shm))
    try:
        base = base_model(work, shape, "cpu")
        tensors = load_file(base / "model.safetensors")
        lora = adapter_tensors(tensors, rank)
        full_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        settings = dict(device="cpu", dtype="float32", max_model_len=256, max_lora_rank=rank)
        engine = make_engine(tiny, policy=WeightsPolicy([str(work)]), **settings)
        say(f"{shape}: {full_bytes / 1e6:.1f} MB of weights; building the engine")
        engine.ensure_weights(str(base))
        base_id = weights_content_id(str(base))
        ring = SlotRing(work / "ring", 2, spool_dir=None, wait_s=10)
        ids = iter(range(10**6))

        def serve(weights_dir: str, content_id: str) -> tuple[float, float, float]:
            """(load s, 1-token generate s after it, the same generate once more)."""
            times = []
            for _ in range(2):
                request = Request(request_id=f"b{next(ids)}", weights_dir=weights_dir, prompt_token_ids=[[1, 5, 6]],
                                  n_samples_per_prompt=1, max_tokens=1, temperature=0.0,
                                  weights_content_id=content_id)  # fmt: skip
                started = time.monotonic()
                done = engine.generate([request])[0]
                times.append((done.reload_s, time.monotonic() - started - done.reload_s))
            return times[0][0], times[0][1], times[1][1]

        keys = ("publish", "load", "first_generate", "generate")
        times = {f"{path}_{key}": [] for path in ("dir", "slot", "adapter") for key in keys}

        def record(path: str, publish_s: float, served: tuple[float, float, float]) -> None:
            for key, value in zip(keys, (publish_s, *served), strict=True):
                times[f"{path}_{key}"].append(value)

        adapter_bytes = 0
        for step in range(1, steps + 1):
            with torch.no_grad():
                for t in [*tensors.values(), *lora.values()]:
                    t.mul_(1.0 + 1e-3)
            started = time.monotonic()
            written = publish(step, tensors, publish_dir=work / "weights", base_model=base)
            record("dir", time.monotonic() - started, serve(str(written.path), written.content_id))
            started = time.monotonic()
            slot = ring.choose()
            in_slot = ring.write(slot, step, f"bench-{step}", as_stream(tensors), torch.float32, base)
            record("slot", time.monotonic() - started, serve(str(in_slot.path), in_slot.content_id))
            assert serve(str(base), base_id)[0] > 0  # the base back, as a LoRA run's engine holds it
            started = time.monotonic()
            adapter = write_adapter_dir(
                published_dir(work / "adapters", step), lora, adapter_config(base, rank), step=step,
                content_id=f"bench-adapter-{step}", base_model=base,
                adapter=Adapter(base_content_id=base_id, rank=rank, alpha=2.0 * rank, target_modules=list(PROJECTIONS)),
            )  # fmt: skip
            record("adapter", time.monotonic() - started, serve(str(adapter.path), adapter.content_id))
            adapter_bytes = adapter.bytes
            shutil.rmtree(written.path)
            say(f"{shape} step {step}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in times.items()))
        engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {key: statistics.median(values) for key, values in times.items()}
    figures = {
        "full_megabytes": round(full_bytes / 1e6, 2),
        "adapter_megabytes": round(adapter_bytes / 1e6, 3),
        **{f"{key}_s_median": round(value, 5) for key, value in med.items()},
    }
    for path in ("dir", "slot", "adapter"):
        figures[f"{path}_sync_s"] = round(med[f"{path}_publish"] + med[f"{path}_load"], 5)
    for path in ("dir", "slot"):
        figures[f"adapter_share_of_{path}"] = round(figures["adapter_sync_s"] / figures[f"{path}_sync_s"], 4)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tiny,mid")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--shm", default="/dev/shm")
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: no engine (loads read the files)")
    args = parser.parse_args()
    if args.tiny:
        args.shapes, args.steps, args.shm = "tiny", 2, tempfile.gettempdir()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(1)  # the trainer's own setting on CPU (run.cpu_threads): the engine has the cores
    figures = {
        shape: measure(shape, args.steps, args.rank, Path(args.shm), args.tiny) for shape in args.shapes.split(",")
    }
    report("lora_sync", {"rank": args.rank, "steps": args.steps, **figures}, args.json)


if __name__ == "__main__":
    main()
