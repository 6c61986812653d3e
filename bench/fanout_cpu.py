"""A step's generation time with one and with two vLLM CPU workers, side by side in one run.

    .venvs/rollout/bin/python -m bench.fanout_cpu [--steps 8] [--rounds 2] [--json OUT]

The demo's shape: build/tiny-model (`make tiny-model`), 16 arithmetic prompts x 8 samples x 4
tokens at temperature 1, each step from weights the workers do not hold yet (two copies of the
model, alternating, as the demo publishes new weights every step: a reload in place per step).
A step is one call split as the trainer splits it, one part per worker, each part naming the
call (`call_id`). Settings, each on a spool of its own with its engines started once:

    one         one worker (vLLM's CPU thread binding left to vLLM, as the demo runs it)
    two         two workers, binding left to vLLM (each binds the same core)
    two-pinned  two workers, each bound to a core of its own (VLLM_CPU_OMP_THREADS_BIND)

The settings take turns, `--steps` steps at a time, `--rounds` times, so a change in the
machine's load falls on all of them. Per step: the wall time from submitting the call to the
last result (what the trainer waits), each part's engine time (`generate_s`, `reload_s`) and
wait in requests/ (`queued_s`), and which worker served each part.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, report
from bench.workers import serving, start_worker, stop
from protocol.client import SpoolClient
from protocol.messages import Request
from protocol.spool import Spool

MODEL = ROOT / "build" / "tiny-model"
PROMPTS, SAMPLES, MAX_TOKENS = 16, 8, 4
SETTINGS = {"one": [None], "two": [None, None], "two-pinned": ["0", "1"]}  # per worker: its OMP binding


def start(
    spool: Spool, worker_id: str, bind: str | None, allowed: Path, log_dir: Path, engine: str
) -> subprocess.Popen:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    weights = ["--weights", str(allowed / "w0")] if engine == "vllm" else []
    args = ["--engine", engine, "--allowed-root", str(allowed), *weights, "--max-model-len", "64", "--idle-exit", "0"]
    return start_worker(spool, worker_id, args, log_dir, env=env)


def wait_ready(spool: Spool, worker_ids: list[str], procs: list[subprocess.Popen], timeout_s: float = 1200) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        ready = {s.worker_id for _, s in spool.statuses() if s is not None and serving(s)}
        if ready >= set(worker_ids):
            return
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"workers {worker_ids} did not start; see their logs")
        time.sleep(0.5)


def one_step(client: SpoolClient, label: str, step: int, weights: Path, parts: int) -> dict:
    """One call of PROMPTS prompts in `parts` parts; returns its wall time and each part's facts."""
    prompts = [f"{(7 * step + i) % 21}+{(3 * i + step) % 21}=" for i in range(PROMPTS)]
    size, call_id = -(-PROMPTS // parts), f"{label}-s{step}"
    requests = [
        Request(
            request_id=f"{call_id}-p{part}",
            call_id=call_id,
            weights_dir=str(weights),
            prompts=prompts[part * size : (part + 1) * size],
            n_samples_per_prompt=SAMPLES,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=step * 100 + part,
        )
        for part in range(parts)
    ]
    started = time.monotonic()
    client.submit_many(requests)
    results = client.wait([r.request_id for r in requests], timeout_s=600)
    wall = time.monotonic() - started
    for result in results.values():
        assert result.ok, result.error
    return {
        "wall_s": wall,
        "generate_s": [r.timings.generate_s for r in results.values()],
        "reload_s": [r.timings.reload_s for r in results.values()],
        "queued_s": [r.timings.queued_s for r in results.values()],
        "workers": sorted(r.worker_id for r in results.values()),
    }


def summary(steps: list[dict]) -> dict:
    walls = [s["wall_s"] for s in steps]
    return {
        "steps": len(steps),
        "wall_ms_median": round(1000 * statistics.median(walls), 1),
        "wall_ms_quartiles": [round(1000 * q, 1) for q in statistics.quantiles(walls, n=4)],
        **{
            f"{what}_ms_per_part_median": round(1000 * statistics.median(t for s in steps for t in s[f"{what}_s"]), 1)
            for what in ("generate", "reload", "queued")
        },
        "steps_served_by_distinct_workers": sum(len(set(s["workers"])) == len(s["workers"]) for s in steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per setting per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2, help="steps per setting before the first round, not counted")
    parser.add_argument("--json")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: echo workers, 2 steps a setting")
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.rounds, args.warmup = 2, 1, 1
    work = Path(tempfile.mkdtemp(prefix="fanout-bench-"))
    for name in ("w0", "w1"):
        if args.tiny:  # the echo engine reads no weights
            (work / name).mkdir()
        else:
            shutil.copytree(MODEL, work / name)
    load_start = os.getloadavg()
    spools, clients, procs = {}, {}, []
    try:
        for label, binds in SETTINGS.items():  # every engine starts at once; each waits idle for its turn
            spools[label] = Spool(work / f"spool-{label}", create=True)
            engine = "echo" if args.tiny else "vllm"
            procs += [start(spools[label], f"{label}-{i}", bind, work, work, engine) for i, bind in enumerate(binds)]
        for label, binds in SETTINGS.items():
            wait_ready(spools[label], [f"{label}-{i}" for i in range(len(binds))], procs)
            clients[label] = SpoolClient(spools[label].root, no_worker_grace_s=60)
        figures: dict[str, list[dict]] = {label: [] for label in SETTINGS}
        step = 0
        for round_ in range(-1, args.rounds):  # round -1: warm-up, not counted
            for label, binds in SETTINGS.items():
                for _ in range(args.warmup if round_ < 0 else args.steps):
                    step += 1
                    done = one_step(clients[label], label, step, work / f"w{step % 2}", len(binds))
                    if round_ >= 0:
                        figures[label].append(done)
        load_end = os.getloadavg()
    finally:
        for client in clients.values():
            client.close()
        for proc in procs:
            stop(proc)
        shutil.rmtree(work, ignore_errors=True)
    out = {label: summary(steps) for label, steps in figures.items()}
    out["speedup_two_pinned_over_one"] = round(out["one"]["wall_ms_median"] / out["two-pinned"]["wall_ms_median"], 2)
    out["speedup_two_over_one"] = round(out["one"]["wall_ms_median"] / out["two"]["wall_ms_median"], 2)
    out["load_average_1min"] = {"start": load_start[0], "end": load_end[0]}
    out["command"] = "python -m bench.fanout_cpu " + " ".join(sys.argv[1:])
    report("fanout_cpu", out, args.json)


if __name__ == "__main__":
    main()
