"""Where a training step's generation through the spool loses time against `LLM.generate`, on one GPU,
at a real model's shape and batch, side by side in one run.

    python -m bench.generation_gap_gpu --model DIR [--prompts 80 --samples 8 --tokens 24]
                                       [--temperature 0.7] [--steps 5] [--setups dedicated,colocated]
                                       [--root /dev/shm] [--random-weights] [--no-compile]
                                       [--generations plain,worker_params,live] [--json OUT]

DIR is an HF directory in bfloat16 (SmolLM2-135M-Instruct in docs/BENCHMARKS.md). Before anything
is timed, the weights of each step are published as a trainer publishes them (trainer_svc.weights.publish
into /dev/shm, every tensor nudged a little per step, so each step's reload loads new values).
Prompts: chat-formatted two-digit additions, the same for every side.

(a) Direct, in a process of its own, one engine built as the worker builds it (rollout_svc's
    LiveEngine), per step: the in-place reload of that step's weights three ways, vLLM's
    `reload_weights` from the directory and the worker extension's `load_files` (files read
    straight onto the GPU) with and without vLLM's post-processing (after each, all the engine's
    tensors are compared with those `reload_weights` gave), the prefix-cache reset, the check of
    the live tensors, and LiveEngine.reload (the worker's, all parts); with sleep mode instead:
    sleep, and the wake part by part. Then generation, in rotating order: `LLM.generate` with one
    SamplingParams (`plain`, what one writes by hand), with the worker's SamplingParams
    (`worker_params`: a seed per prompt, sampling logprobs, texts decoded at the end), with those
    as they were before (`before`: vLLM detokenizing every step, a logprob dict per position),
    with one of those two back (`detokenized_flat`, `dict_logprobs`), without logprobs
    (`no_logprobs`), and LiveEngine.generate (`live`: the worker's whole engine call).
(b) Spool: a real `rollout-svc serve --engine vllm` worker; per step one request naming that
    step's weights (an in-place reload, then the batch), then the same again (weights live). Wall
    time as the producer sees it (submit to result read), split by the result's timings (queued,
    reload, generate) and the rest (result written, found, read), and the worker log's reload lines.

Two setups, each with its own engines: `dedicated` (the worker has the GPU to itself) and
`colocated` (as a colocated trainer spawns its worker: 0.3 of the GPU, asleep at level 2 after
0.5 s without requests; the direct side builds its engine with sleep mode too and times the wake
part by part; each step's request goes once the worker sleeps, as while the trainer steps).

Reported: medians per part, and tokens per second through the spool (a step with new weights, and
one with the weights live) over direct `LLM.generate`'s (`plain`) and over the worker's own call
made directly (`worker_params`). Target: >= 0.95 of `plain`. Ratios are printed, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, gpu_name, say
from bench.models import random_model
from bench.workers import start_worker, stop, wait_until

TARGET_RATIO = 0.95
MAX_MODEL_LEN = 2048
SEED = 1234
COLOCATED_GPU_MEMORY = 0.3  # trainer_svc's rollout.colocate_gpu_memory default
COLOCATED_SLEEP_S = 0.5  # the --sleep-when-idle a colocated trainer gives its worker


# -- inputs ----------------------------------------------------------------------------------------


def chat_prompts(model: Path, count: int) -> list[str]:
    """Two-digit additions in the model's chat format (its template, when it has one)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = []
    for i in range(count):
        a, b = 10 + (i * 37) % 90, 10 + (i * 53 + 11) % 90
        question = f"What is {a} + {b}? Answer with the number only."
        if tokenizer.chat_template:
            prompts.append(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
                )
            )
        else:
            prompts.append(question + "\n")
    return prompts


def publish_steps(model: Path, publish_dir: Path, steps: int) -> list[Path]:
    """Step 0 and `steps` more, published as the trainer publishes (bf16 from the GPU)."""
    import torch
    from safetensors.torch import load_file

    from trainer_svc.weights.publish import publish

    master = {}
    for shard in sorted(model.glob("*.safetensors")):
        master.update({name: t.float() for name, t in load_file(shard, device="cuda").items()})
    published = []
    for step in range(steps + 1):
        # 0.5% more each step: most bf16 values (2**-8 apart) change, so each reload loads new ones.
        tensors = {name: t * (1.0 + 5e-3 * step) for name, t in master.items()}
        record = publish(step, tensors, publish_dir=publish_dir, base_model=model, dtype=torch.bfloat16)
        published.append(record.path)
    del master, tensors
    torch.cuda.empty_cache()
    return published


def fields(args, step: int) -> dict:
    return dict(
        n_samples_per_prompt=args.samples, max_tokens=args.tokens, temperature=args.temperature, seed=SEED + step
    )


# -- (a) direct ------------------------------------------------------------------------------------


def direct(dirs: list[Path], prompts: list[str], root: Path, args, sleep_level: int = 0) -> dict:
    """(a) in a child process: a second engine in one process is what the worker avoids too."""
    out = root / f"direct-{sleep_level}.json"
    inputs = root / "direct-inputs.json"
    inputs.write_text(json.dumps({"dirs": [str(d) for d in dirs], "prompts": prompts, "root": str(root)}))
    command = [sys.executable, "-m", "bench.generation_gap_gpu", "--direct-child", str(inputs), "--json", str(out),
               "--samples", str(args.samples), "--tokens", str(args.tokens), "--sleep-level", str(sleep_level),
               "--temperature", str(args.temperature), "--model", str(args.model),
               "--generations", args.generations] + (["--no-compile"] if args.no_compile else [])  # fmt: skip
    subprocess.run(command, check=True, cwd=ROOT)
    return json.loads(out.read_text())


def timed(fn, *a, **k) -> tuple[object, float]:
    started = time.perf_counter()
    value = fn(*a, **k)
    return value, time.perf_counter() - started


def direct_child(args) -> None:
    from vllm import SamplingParams

    from protocol.messages import Request
    from rollout_svc.engines.vllm_host import EngineSpec, LiveEngine
    from rollout_svc.engines.vllm_requests import sampling_params
    from rollout_svc.weights import WeightsPolicy

    spec = json.loads(Path(args.direct_child).read_text())
    dirs, prompts = spec["dirs"], spec["prompts"]
    policy = WeightsPolicy([spec["root"]])
    engine = LiveEngine()
    engine_spec = EngineSpec(device="cuda:0", dtype="bfloat16", seed=0, max_model_len=MAX_MODEL_LEN,
                             enforce_eager=False, gpu_memory_utilization=COLOCATED_GPU_MEMORY if args.sleep_level
                             else 0.85, kv_cache_gib=1.0, sleep_mode=bool(args.sleep_level),
                             compile=not args.no_compile)  # fmt: skip
    _, build_s = timed(engine.build, engine_spec, policy.inspect(dirs[0]))
    llm = engine.llm
    tokenizer = llm.get_tokenizer()
    token_ids = [tokenizer(p)["input_ids"] for p in prompts]
    sizes = llm.collective_rpc("parameter_sizes")[0]
    whole = {name: [(0, shape[0])] for name, shape in sizes.items() if shape}

    def checksums():
        return llm.collective_rpc("parameter_sums", args=(whole,))[0]

    def plain(step):
        f = fields(args, step)
        params = SamplingParams(n=f["n_samples_per_prompt"], max_tokens=f["max_tokens"],
                                temperature=f["temperature"], seed=f["seed"])  # fmt: skip
        return llm.generate(prompts, params, use_tqdm=False)

    def per_prompt(step, **options):
        """A SamplingParams per prompt as the worker's, with `options` over rollout_svc's."""
        request = Request(request_id=f"d{step}", weights_dir=dirs[step], prompts=prompts, **fields(args, step))
        params = [sampling_params(request, i, **options) for i in range(len(prompts))]
        return llm.generate([{"prompt_token_ids": ids} for ids in token_ids], params, use_tqdm=False)

    def worker_params(step):
        return per_prompt(step)

    def before(step):  # the worker's SamplingParams before they left detokenizing to the end
        return per_prompt(step, detokenize=True, flat_logprobs=False)

    def detokenized_flat(step):
        return per_prompt(step, detokenize=True)

    def dict_logprobs(step):
        return per_prompt(step, flat_logprobs=False)

    def no_logprobs(step):
        return per_prompt(step, logprobs=None)

    def live(step):
        request = Request(request_id=f"direct-{step}", weights_dir=dirs[step], prompts=prompts, **fields(args, step))
        return engine.generate([request])

    def count(name, outputs) -> int:
        if name == "live":
            return sum(len(t) for p in outputs[0].token_ids for t in p)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    generations = [("plain", plain), ("worker_params", worker_params), ("live", live), ("before", before),
                   ("detokenized_flat", detokenized_flat), ("dict_logprobs", dict_logprobs),
                   ("no_logprobs", no_logprobs)]  # fmt: skip
    wanted = set(args.generations.split(","))
    generations = [(name, fn) for name, fn in generations if name in wanted]
    for _, warm in generations:  # the first calls of each shape pay for warm-up
        warm(0)
    rows = []
    for step in range(1, len(dirs)):
        weights = policy.inspect(dirs[step])
        row = {"step": step}
        _, row["rpc_noop_s"] = timed(llm.collective_rpc, "parameter_sizes")
        if args.sleep_level:
            # The worker's wake, part by part (LiveEngine.wake), from a sleep as deep as the worker's.
            _, row["sleep_s"] = timed(engine.sleep, args.sleep_level)
            _, row["wake_weights_s"] = timed(llm.wake_up, tags=["weights"])
            _, row["reload_weights_s"] = timed(engine._load_checked, weights, post_process=True)
            _, row["wake_kv_cache_s"] = timed(llm.wake_up, tags=["kv_cache"])
            _, row["reset_prefix_cache_s"] = timed(llm.reset_prefix_cache)
            _, row["verify_s"] = timed(engine._verify, weights)
            outputs, row["plain_first_after_wake_s"] = timed(plain, step)
        else:
            _, row["reload_weights_s"] = timed(
                llm.collective_rpc, "reload_weights", kwargs={"weights_path": weights.real_path}
            )
            reference = checksums()
            paths = [os.path.join(weights.real_path, s) for s in weights.shards]
            for variant in ("layerwise", "direct"):
                _, row[f"load_files_{variant}_s"] = timed(
                    llm.collective_rpc, "load_files", args=(paths, variant == "layerwise")
                )
                row[f"load_files_{variant}_equal"] = checksums() == reference
            _, row["reset_prefix_cache_s"] = timed(llm.reset_prefix_cache)
            _, row["verify_s"] = timed(engine._verify, weights)
            _, row["live_reload_s"] = timed(engine.reload, weights)  # what the worker calls, all parts
        # Generation, rotating which goes first so that none always follows a reload.
        order = generations[step % len(generations) :] + generations[: step % len(generations)]
        for name, fn in order:
            outputs, row[f"{name}_s"] = timed(fn, step)
            row[f"{name}_tokens"] = count(name, outputs)
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.json).write_text(json.dumps({"build_s": build_s, "rows": rows}))
    engine.shutdown()


# -- (b) spool -------------------------------------------------------------------------------------


def through_spool(dirs: list[Path], prompts: list[str], root: Path, args, sleep_level: int = 0) -> dict:
    """(b) a real worker; with `sleep_level`, set up as a colocated trainer spawns it (a share of
    the GPU, asleep after 0.5 s without requests), each step's request sent once it sleeps."""
    from protocol.client import SpoolClient
    from protocol.messages import Request
    from protocol.spool import Spool

    spool = Spool(root / f"spool-{sleep_level}", create=True)
    worker_id = f"bench-gap-{sleep_level}"
    worker_args = ["--engine", "vllm", "--weights", str(dirs[0]), "--allowed-root", str(root),
                   "--idle-exit", "0", "--max-model-len", str(MAX_MODEL_LEN)]  # fmt: skip
    if args.no_compile:
        worker_args.append("--no-compile")
    if sleep_level:
        worker_args += ["--gpu-memory-utilization", str(COLOCATED_GPU_MEMORY), "--sleep-when-idle",
                        str(COLOCATED_SLEEP_S), "--sleep-level", str(sleep_level)]  # fmt: skip
    proc = start_worker(spool, worker_id, worker_args, root)
    rows = []
    try:
        wait_until(spool, worker_id, lambda s: s.state in ("idle", "sleeping") and s.weights_dir, timeout_s=900)
        with SpoolClient(spool.root) as client:

            def serve(request_id: str, weights: Path, step: int) -> dict:
                request = Request(
                    request_id=request_id, weights_dir=str(weights), prompts=prompts, **fields(args, step)
                )
                started = time.perf_counter()
                client.submit(request)
                result = client.wait([request_id], timeout_s=600)[request_id]
                wall = time.perf_counter() - started
                assert result.ok, result.error
                t = result.timings
                return {
                    "wall_s": wall,
                    "queued_s": t.queued_s,
                    "reload_s": t.reload_s,
                    "generate_s": t.generate_s,
                    "rest_s": wall - t.queued_s - t.reload_s - t.generate_s,
                    "tokens": sum(len(x) for p in result.token_ids for x in p),
                }

            serve("warm-0", dirs[0], 0)
            for step in range(1, len(dirs)):
                if sleep_level:  # as while the trainer trains and publishes
                    wait_until(spool, worker_id, lambda s: s.state == "sleeping", timeout_s=120)
                row = {"step": step, "new": serve(f"step-{step}-new", dirs[step], step)}
                row["same"] = serve(f"step-{step}-same", dirs[step], step)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        stop(proc)
    log = (root / f"{worker_id}.log").read_text(errors="replace")
    wanted = re.compile(r"reloaded|awake|generated|Reloading")
    return {"rows": rows, "log_lines": [line for line in log.splitlines() if wanted.search(line)]}


# -- report ----------------------------------------------------------------------------------------


def median(rows: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 4)


def summary(d: dict, s: dict) -> dict:
    """Medians of each part, and tokens per second through the spool over direct `LLM.generate`'s."""
    direct_rows, new, same = d["rows"], [r["new"] for r in s["rows"]], [r["same"] for r in s["rows"]]
    plain_rate = statistics.median(r["plain_tokens"] / r["plain_s"] for r in direct_rows)
    same_call_rate = statistics.median(r["worker_params_tokens"] / r["worker_params_s"] for r in direct_rows)
    new_rate = statistics.median(r["tokens"] / r["wall_s"] for r in new)
    same_rate = statistics.median(r["tokens"] / r["wall_s"] for r in same)
    return {
        "engine_build_s": round(d["build_s"], 1),
        "direct": {key: median(direct_rows, key) for key in direct_rows[0] if key.endswith("_s")},
        "direct_load_files_equal": all(r[k] for r in direct_rows for k in r if k.endswith("_equal")),
        "spool_new_weights": {key: median(new, key) for key in new[0]},
        "spool_same_weights": {key: median(same, key) for key in same[0]},
        "plain_tokens_per_s": round(plain_rate),
        "spool_new_tokens_per_s": round(new_rate),
        "spool_same_tokens_per_s": round(same_rate),
        "spool_new_over_direct": round(new_rate / plain_rate, 3),
        "spool_same_over_direct": round(same_rate / plain_rate, 3),
        "spool_new_over_same_call": round(new_rate / same_call_rate, 3),
        "spool_same_over_same_call": round(same_rate / same_call_rate, 3),
        "worker_log": s["log_lines"][-30:],
        "runs": {"direct": direct_rows, "spool": s["rows"]},
    }


def tiny(args) -> None:
    """--tiny, the CPU check of the script: the prompts through a tokenizer (a tiny one without
    --model), then the report of made-up rows of both sides."""
    from bench.tokenizer_check import tiny_tokenizer

    prompts = chat_prompts(args.model or tiny_tokenizer(), 4)
    direct_row = {"step": 1, "load_files_direct_equal": True} | {f"{g}_s": 0.1 for g in GENERATIONS}
    direct_row |= {f"{g}_tokens": 64 for g in GENERATIONS}
    spool_row = {"wall_s": 0.2, "queued_s": 0.01, "reload_s": 0.05, "generate_s": 0.1, "rest_s": 0.04, "tokens": 64}
    spool = {"rows": [{"step": 1, "new": spool_row, "same": spool_row}], "log_lines": []}
    data = {
        "benchmark": "generation_gap_gpu",
        "prompts": prompts,
        "figures": summary({"build_s": 1.0, "rows": [direct_row]}, spool),
    }
    print(json.dumps(data))
    if args.json:
        Path(args.json).write_text(json.dumps(data) + "\n")


GENERATIONS = ("plain", "worker_params", "live", "before", "detokenized_flat", "dict_logprobs", "no_logprobs")
SETUPS = {"dedicated": 0, "colocated": 2}  # the worker's sleep level: none, or a colocated trainer's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, help="an HF model directory (bfloat16 safetensors; required but with --tiny)"
    )
    parser.add_argument("--prompts", type=int, default=80)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--setups", default="dedicated,colocated", help=f"comma-separated, of {', '.join(SETUPS)}")
    parser.add_argument("--root", default="/dev/shm", help="where the published weights and the spool go")
    parser.add_argument("--json", help="also write the JSON line here")
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="the model's shape and tokenizer with random weights: every completion runs to --tokens",
    )
    parser.add_argument(
        "--no-compile", action="store_true", help="both engines without torch.compile (as serve --no-compile)"
    )
    parser.add_argument(
        "--generations",
        default=",".join(GENERATIONS),
        help="comma-separated direct generations to time; plain and worker_params are always kept (the ratios' bases)",
    )
    parser.add_argument("--direct-child", help=argparse.SUPPRESS)  # internal: run (a) in its own process
    parser.add_argument("--sleep-level", type=int, default=0, help=argparse.SUPPRESS)  # internal, with the above
    parser.add_argument("--tiny", action="store_true", help="the CPU check: the prompts, the report of made-up rows")
    args = parser.parse_args()
    if args.tiny:
        tiny(args)
        return
    if not args.model:
        parser.error("--model is required")
    if args.direct_child:
        direct_child(args)
        return
    generations = set(args.generations.split(",")) | {"plain", "worker_params"}
    if generations - set(GENERATIONS):
        unknown = sorted(generations - set(GENERATIONS))
        parser.error(f"unknown --generations {unknown}; choose from {', '.join(GENERATIONS)}")
    args.generations = ",".join(g for g in GENERATIONS if g in generations)
    setups = args.setups.split(",")
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        parser.error(f"unknown --setups {unknown}; choose from {', '.join(SETUPS)}")
    root = Path(tempfile.mkdtemp(prefix="bench-gap-", dir=args.root))
    figures = {}
    try:
        if args.random_weights:
            args.model = random_model(args.model, root / "random-model", seed=SEED)
        say(f"publishing {args.steps + 1} steps of {args.model} into {root}")
        prompts = chat_prompts(args.model, args.prompts)
        dirs = publish_steps(args.model, root / "published", args.steps)
        for setup in setups:
            level = SETUPS[setup]
            say(f"{setup}: direct, one engine: reloads and LLM.generate")
            d = direct(dirs, prompts, root, args, level)
            say(f"{setup}: through the spool: a worker, a new step's weights per request")
            s = through_spool(dirs, prompts, root, args, level)
            figures[setup] = summary(d, s)
            say(f"{setup}: {json.dumps({k: v for k, v in figures[setup].items() if k != 'runs'}, indent=1)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    import vllm

    data = {
        "benchmark": "generation_gap_gpu",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"gpu": gpu_name(), "cores": os.cpu_count(), "vllm": vllm.__version__},
        "model": str(args.model) + (" (random weights)" if args.random_weights else ""),
        "batch": f"{args.prompts} prompts x {args.samples} samples x <= {args.tokens} tokens, "
        f"temperature {args.temperature}",
        "target_ratio": TARGET_RATIO,
        "figures": figures,
    }
    print(json.dumps(data))
    if args.json:
        Path(args.json).write_text(json.dumps(data) + "\n")


if __name__ == "__main__":
    main()
