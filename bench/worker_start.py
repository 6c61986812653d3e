"""A rollout worker's start and its generation, with vLLM's torch.compile and without, side by side
in one run: what `--no-compile` saves at launch and what it costs per engine call.

    python -m bench.worker_start --model DIR [--launches compile-cold,compile-warm,no-compile]
                                 [--calls 5] [--prompts 64 --samples 8 --tokens 16] [--json OUT]

Each launch is a real `rollout-svc serve --weights DIR` (bfloat16 on a GPU, 0.3 of it, as a
colocated trainer spawns it), timed from the process start to its status saying it is ready, split
by its log (the engine process's build, vLLM's torch.compile, CUDA graph capture, the engine's
initialisation). Then `--calls` requests, the same weights, each `--prompts` chat-formatted
two-digit additions x `--samples` x at most `--tokens` tokens at temperature 0.7: the median
engine call (the result's generate_s) and tokens per second.

Launches: `compile-cold` (vLLM's defaults, its compile cache emptied first: a first launch),
`compile-warm` (the same, the cache the launch before left: every launch after the first),
`no-compile` (`--no-compile`: no torch.compile, decode steps as whole-step CUDA graphs). The
compile cache is this run's own (VLLM_CACHE_ROOT under --root), so the user's is left alone.
On a CPU the engine is eager whatever the flag; a CPU run only checks the script.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import report
from bench.generation_gap_gpu import chat_prompts
from bench.workers import serving, start_worker, stop, wait_until

LAUNCHES = ("compile-cold", "compile-warm", "no-compile")
# Lines of the worker's log that say where its start went.
PARTS = re.compile(
    r"engine (process \d+ )?built for|torch\.compile take|Compiling a graph|Graph capturing finished|"
    r"init engine|Loading weights took|Model loading took|Dynamo bytecode transform"
)


def launch(name: str, model: Path, prompts: list[str], root: Path, args) -> dict:
    from protocol.client import SpoolClient
    from protocol.messages import Request
    from protocol.spool import Spool

    cache = root / "vllm-cache"
    if name == "compile-cold":
        shutil.rmtree(cache, ignore_errors=True)
    os.environ["VLLM_CACHE_ROOT"] = str(cache)  # the worker inherits it
    spool = Spool(root / f"spool-{name}", create=True)
    engine = ["--engine", "echo"] if args.tiny else ["--engine", "vllm", "--weights", str(model)]
    worker_args = [*engine, "--allowed-root", str(model.parent), "--idle-exit", "0", "--max-model-len", "512"]
    if args.gpu:
        worker_args += ["--gpu-memory-utilization", "0.3"]
    if name == "no-compile":
        worker_args.append("--no-compile")
    started = time.perf_counter()
    proc = start_worker(spool, name, worker_args, root)
    try:
        wait_until(spool, name, serving, timeout_s=900)
        ready_s = time.perf_counter() - started
        calls = []
        with SpoolClient(spool.root) as client:
            for call in range(args.calls + 1):  # the first warms up, as a trainer's step 0 would
                request = Request(
                    request_id=f"{name}-{call}", weights_dir=str(model), prompts=prompts,
                    n_samples_per_prompt=args.samples, max_tokens=args.tokens, temperature=0.7, seed=call,
                )  # fmt: skip
                client.submit(request)
                result = client.wait([request.request_id], timeout_s=600)[request.request_id]
                assert result.ok, result.error
                tokens = sum(len(x) for p in result.token_ids for x in p)
                calls.append({"generate_s": result.timings.generate_s, "tokens": tokens})
                print(f"{name} call {call}: {result.timings.generate_s:.3f} s, {tokens} tokens", flush=True)
    finally:
        stop(proc)
    timed = calls[1:]
    log = (root / f"{name}.log").read_text(errors="replace")
    return {
        "ready_s": round(ready_s, 1),
        "generate_s_median": round(statistics.median(c["generate_s"] for c in timed), 4),
        "tokens_per_s_median": round(statistics.median(c["tokens"] / c["generate_s"] for c in timed)),
        "calls": calls,
        "log_parts": [line[:240] for line in log.splitlines() if PARTS.search(line)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="an HF model directory (required but with --tiny)")
    parser.add_argument("--launches", default=",".join(LAUNCHES), help=f"comma-separated, of {', '.join(LAUNCHES)}")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--root", default=None, help="where the spools, logs and compile cache go")
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: echo workers, 2 calls each")
    args = parser.parse_args()
    if args.tiny:
        from bench.tokenizer_check import tiny_tokenizer

        args.model = args.model or tiny_tokenizer()  # the prompts need a tokenizer, the echo no weights
        args.calls, args.prompts, args.samples, args.tokens = 2, 4, 2, 8
    elif not args.model:
        parser.error("--model is required")
    names = args.launches.split(",")
    unknown = set(names) - set(LAUNCHES)
    if unknown:
        parser.error(f"unknown launches {sorted(unknown)}; choose from {', '.join(LAUNCHES)}")
    import torch

    args.gpu = torch.cuda.is_available()
    model = args.model.resolve()
    prompts = chat_prompts(model, args.prompts)
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-worker-start-"))
    root.mkdir(parents=True, exist_ok=True)
    figures = {}
    for name in names:
        figures[name] = launch(name, model, prompts, root, args)
        f = figures[name]
        print(f"{name}: ready {f['ready_s']} s, engine call {f['generate_s_median']} s, "
              f"{f['tokens_per_s_median']} tokens/s", flush=True)  # fmt: skip
    batch = {"prompts": args.prompts, "samples": args.samples, "tokens": args.tokens, "calls": args.calls}
    report("worker_start", {"model": str(model), "gpu": args.gpu, **batch, "launches": figures}, args.json)


if __name__ == "__main__":
    main()
