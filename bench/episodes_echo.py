"""Many concurrent multi-turn episodes through the spool, their turns batched by TurnBatcher.

    .venvs/trainer/bin/python -m bench.episodes_echo [--episodes 1000] [--workers 4] [--tiny] [--json OUT]

`--episodes` synthetic episodes run at once against `--workers` real `rollout-svc serve --engine
echo` processes. Each episode takes `--turns` turns: its first prompt is a few token ids; after
each turn it thinks a random 0..`--think-ms` ms, then sends its whole history (the prompt, the
engine's completion, a few ids of a new environment turn) as its next turn, preferring the worker
that served the previous one. All turns go through one TurnBatcher, twice, on fresh spools with
fresh workers: batching on (`--max-prompts` prompts a request, `--max-wait-s`) and batching off
(max_prompts_per_request = 1: one request per turn, as without a batcher).

Per run: spool requests per second (request files published / wall time), request files per
turn, turns per second, p50 and p99 turn latency (put to outcome in hand), the share of later
turns served by the worker of the episode's previous turn (sticky), and resends. Every episode
must finish with every turn's completion the echo of its prompt, or the run fails.

`--sshfs`: both runs again with the spools on an sshfs mount (the tests' own: an sshd on a
loopback port, tests/netfs.py), rows marked `storage`: the spool's cost per turn on a network
filesystem against local disk (needs sshfs and sshd: `apt-get install sshfs openssh-server`).

`--tiny`: 40 episodes of 3 turns on 2 workers, for the test that runs this script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench.common import ROLLOUT_VENV, percentile
from bench.workers import EchoWorkers
from protocol.client import SpoolClient
from protocol.spool import Spool
from trainer_svc.rollout.turn_batcher import Turn, TurnBatcher

ROLLOUT_SVC = ROLLOUT_VENV / "bin" / "rollout-svc"
MAX_TOKENS = 16  # the echo's completion: the first 16 ids of the prompt
ENV_IDS = 6  # ids of each environment turn appended after a completion


def run_episodes(batcher: TurnBatcher, episodes: int, turns: int, think_s: float, seed: int) -> dict:
    """Drive `episodes` episodes of `turns` turns to their end; returns the figures."""
    rng = random.Random(seed)
    history = {e: [rng.randrange(32, 127) for _ in range(8)] for e in range(episodes)}
    done_turns = dict.fromkeys(range(episodes), 0)
    served_by: dict[int, str] = {}
    ready: list[tuple[float, int]] = []  # (when, episode): turns whose think time runs
    put_at: dict[str, float] = {}
    latencies, sticky, later = [], 0, 0

    def put(episode: int) -> None:
        key = f"ep{episode}.t{done_turns[episode]}"
        put_at[key] = time.monotonic()
        seed_of_turn = episode * 1000 + done_turns[episode]
        batcher.put(Turn(key, list(history[episode]), seed_of_turn, served_by.get(episode)))

    started = time.monotonic()
    for episode in range(episodes):
        put(episode)
    while batcher.pending() or ready:
        now = time.monotonic()
        for when, episode in [r for r in ready if r[0] <= now]:
            ready.remove((when, episode))
            put(episode)
        wait = min([w for w, _ in ready], default=now + 0.05) - now
        for outcome in batcher.poll(max(0.0, min(wait, 0.05))):
            arrived = time.monotonic()
            latencies.append(arrived - put_at.pop(outcome.key))
            episode = int(outcome.key[2:].split(".")[0])
            if outcome.token_ids != history[episode][:MAX_TOKENS]:
                raise SystemExit(f"turn {outcome.key} came back with another prompt's completion")
            if episode in served_by:
                later += 1
                sticky += outcome.worker_id == served_by[episode]
            served_by[episode] = outcome.worker_id
            done_turns[episode] += 1
            if done_turns[episode] < turns:
                history[episode] += outcome.token_ids + [rng.randrange(32, 127) for _ in range(ENV_IDS)]
                ready.append((arrived + rng.uniform(0.0, think_s), episode))
    elapsed = time.monotonic() - started
    total = sum(done_turns.values())
    assert total == episodes * turns, (total, episodes * turns)
    return {
        "turns": total,
        "wall_s": round(elapsed, 3),
        "requests": batcher.requests_sent,
        "requests_per_s": round(batcher.requests_sent / elapsed, 1),
        "files_per_turn": round(batcher.requests_sent / total, 4),
        "turns_per_s": round(total / elapsed, 1),
        "p50_turn_ms": round(1000 * percentile(latencies, 50), 1),
        "p99_turn_ms": round(1000 * percentile(latencies, 99), 1),
        "sticky": round(sticky / later, 4) if later else None,
        "resent": batcher.resent,
    }


def sshfs_spools(top: Path):
    """A directory on an sshfs mount of `top/export`, for the spools; unmounted on exit."""
    from tests.netfs import SshServer, missing_prerequisites, sshfs_mount  # the tests' mount helpers

    missing = missing_prerequisites("sshfs")
    if missing:
        raise SystemExit(f"cannot mount sshfs: missing {', '.join(missing)} (apt-get install sshfs openssh-server)")
    stack = contextlib.ExitStack()
    server = SshServer(top / "sshd").start()
    stack.callback(server.stop)
    (top / "export").mkdir()
    return stack, stack.enter_context(sshfs_mount(server, top / "export", top / "mnt"))


def one_run(base: Path, name: str, args, max_prompts: int) -> dict:
    spool = Spool(base / name, create=True)
    log_dir = base / f"{name}-logs"
    log_dir.mkdir()
    workers = EchoWorkers(spool, args.workers, log_dir, command=[str(args.rollout_svc)])
    with workers, SpoolClient(spool.root) as client:
        batcher = TurnBatcher(
            client, weights_dir="/models/none", weights_content_id=None, max_tokens=MAX_TOKENS, temperature=1.0,
            top_p=1.0, stop=[], max_wait_s=args.max_wait_s, max_prompts_per_request=max_prompts, tag=name,
        )  # fmt: skip
        try:
            figures = run_episodes(batcher, args.episodes, args.turns, args.think_ms / 1000, args.seed)
        finally:
            batcher.close()
    return {"batching": name, "max_prompts_per_request": max_prompts, **figures}


def table(rows: list[dict]) -> str:
    columns = ["storage", "batching", "max_prompts_per_request", "turns", "requests", "requests_per_s",
               "files_per_turn", "turns_per_s", "p50_turn_ms", "p99_turn_ms", "sticky", "resent"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=1000, help="episodes in flight at once (default 1000)")
    parser.add_argument("--turns", type=int, default=4, help="turns per episode (default 4)")
    parser.add_argument("--workers", type=int, default=4, help="echo workers (default 4)")
    parser.add_argument("--think-ms", type=float, default=5.0, help="most think time between turns (default 5)")
    parser.add_argument("--max-wait-s", type=float, default=0.05, help="TurnBatcher's max_wait_s (default 0.05)")
    parser.add_argument("--max-prompts", type=int, default=256, help="prompts per request, batching on (default 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="40 episodes of 3 turns on 2 workers")
    parser.add_argument("--spool-dir", type=Path, default=None, help="where the spools go (default: a temp dir)")
    parser.add_argument("--rollout-svc", type=Path, default=ROLLOUT_SVC, help="the rollout-svc command")
    parser.add_argument("--sshfs", action="store_true", help="both runs again with the spools on an sshfs mount")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    if args.tiny:
        args.episodes, args.turns, args.workers = 40, 3, 2
    rows = []
    with tempfile.TemporaryDirectory(dir=args.spool_dir) as tmp:
        base = Path(tmp)
        rows += [
            {"storage": "local"} | one_run(base, name, args, m) for name, m in (("on", args.max_prompts), ("off", 1))
        ]
        if args.sshfs:
            stack, mount = sshfs_spools(base / "net")
            with stack:
                for name, most in (("on", args.max_prompts), ("off", 1)):
                    rows.append({"storage": "sshfs"} | one_run(mount, name, args, most))
    command = " ".join(["python -m bench.episodes_echo", *sys.argv[1:]])
    settings = {"episodes": args.episodes, "turns": args.turns, "workers": args.workers, "think_ms": args.think_ms}
    report = {
        "command": command,
        "machine": common.machine() | {"loadavg": os.getloadavg()[0]},
        **settings,
        "max_wait_s": args.max_wait_s,
        "rows": rows,
    }
    print(table(rows))
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
