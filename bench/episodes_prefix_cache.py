"""Multi-turn episodes on real vLLM workers: the prefix-cache hit rate with sticky routing and
without, and the spool's share of a turn against the engine call's.

    .venvs/trainer/bin/python -m bench.episodes_prefix_cache [--episodes 32] [--turns 4] [--workers 2] [--json OUT]

`--workers` real `rollout-svc serve --engine vllm` processes (vLLM's CPU build here; the tiny
model, build/tiny-model, or --model) serve one spool. `--episodes` episodes run at once through
one TurnBatcher, twice on the same workers, each time with fresh random prompts (nothing one run
sent can be in a cache for the other), after a warm-up run that is not counted (an engine's first
calls are slow): sticky on (each turn prefers the worker of its episode's previous turn, as the
trainer's episodes do) and off (each turn goes to a worker drawn at random, as a router without
affinity sends it). A turn's prompt is the whole history: the first prompt (`--prompt-tokens`
random ids), then each completion and `--env-tokens` ids of an environment turn. The cache holds
whole blocks of the engine's block size (vLLM's CPU build: 128 tokens), so the first prompt
spans several.

Figures per run: the prefix-cache hit rate of later turns (prompt tokens the worker's cache
served, from the results' `prompt_cached_tokens`, over their prompt tokens; the first turns are
left out: nothing can be cached for them), the share of later turns on the previous turn's
worker, p50 and p99 turn latency (put to outcome), the p50 engine time of the requests the turns
travelled in, and the spool's share of a turn (p50 latency less p50 engine time, over p50 latency).

`--tiny`: echo workers stand in for vLLM (no prefix cache: the hit rate reads "not reported"),
8 episodes of 2 turns, for the test that runs every script's tiny mode.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench.common import ROOT, percentile
from bench.workers import serving, start_worker, stop
from protocol.client import SpoolClient
from protocol.spool import Spool
from trainer_svc.rollout.turn_batcher import Turn, TurnBatcher

MODEL = ROOT / "build" / "tiny-model"


def start_workers(spool: Spool, args, log_dir: Path) -> list:
    engine = ["--engine", "echo"] if args.tiny else ["--engine", "vllm", "--weights", str(args.model)]
    settings = ["--allowed-root", str(args.model.parent), "--max-model-len", str(args.max_model_len)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    procs = [
        start_worker(spool, f"w{i}", [*engine, *settings, "--idle-exit", "0"], log_dir, env=env)
        for i in range(args.workers)
    ]
    deadline = time.monotonic() + 1200
    while {s.worker_id for _, s in spool.statuses() if s is not None and serving(s)} < {
        f"w{i}" for i in range(args.workers)
    }:
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise SystemExit(f"the workers did not start; see {log_dir}")
        time.sleep(0.5)
    return procs


def run(batcher: TurnBatcher, args, sticky: bool, seed: int, vocab: int) -> dict:
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(args.workers)]
    history = {e: [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)] for e in range(args.episodes)}
    done = dict.fromkeys(history, 0)
    served_by: dict[int, str] = {}
    put_at: dict[str, float] = {}
    latencies, engine_s, cached, prompt_tokens, same_worker, later = [], [], [], [], 0, 0
    reported = True

    def put(episode: int) -> None:
        key = f"ep{episode}.t{done[episode]}"
        put_at[key] = time.monotonic()
        prefer = served_by.get(episode) if sticky else rng.choice(workers)
        batcher.put(Turn(key, list(history[episode]), episode * 1000 + done[episode], prefer))

    started = time.monotonic()
    for episode in history:
        put(episode)
    while batcher.pending():
        for outcome in batcher.poll(0.05):
            latencies.append(time.monotonic() - put_at.pop(outcome.key))
            engine_s.append(outcome.engine_s)
            episode = int(outcome.key[2:].split(".")[0])
            if episode in served_by:
                later += 1
                same_worker += outcome.worker_id == served_by[episode]
                prompt_tokens.append(len(history[episode]))
                reported &= outcome.cached_tokens is not None
                cached.append(outcome.cached_tokens or 0)
            served_by[episode] = outcome.worker_id
            done[episode] += 1
            if done[episode] < args.turns:
                history[episode] += outcome.token_ids + [rng.randrange(10, vocab) for _ in range(args.env_tokens)]
                put(episode)
    wall = time.monotonic() - started
    p50, engine_p50 = percentile(latencies, 50), statistics.median(engine_s)
    return {
        "sticky": sticky,
        "turns": len(latencies),
        "wall_s": round(wall, 2),
        "requests": batcher.requests_sent,
        "prefix_cache_hit_rate": round(sum(cached) / sum(prompt_tokens), 4) if reported and later else None,
        "later_turns_on_previous_worker": round(same_worker / later, 4) if later else None,
        "p50_turn_ms": round(1000 * p50, 1),
        "p99_turn_ms": round(1000 * percentile(latencies, 99), 1),
        "p50_engine_ms": round(1000 * engine_p50, 1),
        "spool_share_of_turn": round(max(0.0, p50 - engine_p50) / p50, 4) if p50 else None,
    }


def table(rows: list[dict]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=300, help="random ids of each episode's first prompt")
    parser.add_argument("--env-tokens", type=int, default=6, help="ids of each environment turn")
    parser.add_argument("--max-tokens", type=int, default=8, help="completion tokens a turn")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-wait-s", type=float, default=0.05, help="TurnBatcher's max_wait_s")
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tiny", action="store_true", help="echo workers, 8 episodes of 2 turns")
    args = parser.parse_args()
    top = Path(tempfile.mkdtemp(prefix="episodes-prefix-"))
    if args.tiny:
        args.episodes, args.turns, args.prompt_tokens = 8, 2, 16
        args.model = top / "models" / "none"  # the echo engine reads no weights
        args.model.mkdir(parents=True)
    vocab = 100 if args.tiny else json.loads((args.model / "config.json").read_text())["vocab_size"]
    spool = Spool(top / "spool", create=True)
    procs, rows = [], []
    try:
        procs = start_workers(spool, args, top)
        with SpoolClient(spool.root) as client:
            for index, sticky in enumerate((None, True, False)):  # None: the warm-up, not counted
                batcher = TurnBatcher(
                    client, weights_dir=str(args.model), weights_content_id=None, max_tokens=args.max_tokens,
                    temperature=1.0, top_p=1.0, stop=[], max_wait_s=args.max_wait_s, tag=f"run{index}",
                )  # fmt: skip
                try:
                    row = run(batcher, args, bool(sticky), args.seed + index, vocab)
                    if sticky is not None:
                        rows.append(row)
                finally:
                    batcher.close()
    finally:
        for proc in procs:
            stop(proc, grace_s=30)
        shutil.rmtree(top, ignore_errors=True)
    settings = {k: getattr(args, k) for k in ("episodes", "turns", "workers", "prompt_tokens", "env_tokens")}
    report = {
        "command": " ".join(["python -m bench.episodes_prefix_cache", *sys.argv[1:]]),
        "machine": common.machine() | {"loadavg": os.getloadavg()[0]},
        **settings,
        "max_tokens": args.max_tokens,
        "engine": "echo" if args.tiny else "vllm",
        "rows": rows,
    }
    print(table(rows))
    common.emit(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
