"""Spool under load: echo workers and producers, with done/ empty and with done/ full.

    .venvs/rollout/bin/python -m bench.spool_load [--requests 20000] [--done-files 100000] [--json OUT]

(a) Load: two runs on two fresh spools, otherwise alike: `--workers` (4) real `rollout-svc serve
    --engine echo` processes and `--producers` (2) producer processes, which submit `--requests`
    requests in submit_many batches and wait for every result. One spool's done/ starts empty,
    the other's with `--done-files` files, as a spool holds them between prunes. Per run:
    requests/s (first submit to last result in hand); the workers' CPU seconds per 1000
    requests (/proc/<pid>/stat); each worker's peak resident memory (VmHWM); and nothing lost:
    every request has exactly one result, ok and with the expected text, and requests/,
    claimed/ and results/ are empty at the end.
(b) A request's path, side by side: in this process, on two more spools (done/ empty and
    done/ full), blocks of requests go through every spool call a request meets (submit_many,
    the worker's scan, claim, load, has_result, publish_results, finish, a lease recovery pass;
    the producer's read_result and consume_result), alternating between the spools block by
    block so that foreign load falls on both alike; seconds per request, median of the blocks.
(c) The full spool of (a) is pruned as `spoolctl prune` does (Spool.prune), cutting at the
    moment its run started: the files left before it go, the run's own stay.

Target: with done/ full, a request's path (b) and the workers' peak memory (a) within 1.25 x of
done/ empty. The rates and CPU seconds of (a) are reported, but on a shared machine they move
with foreign load, and more than the load itself: workers that fall behind face a deeper
requests/ to scan, which costs more per request.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.spool_roundtrip import _produce, machine, make_request
from bench.workers import EchoWorkers
from protocol.messages import Result, decode_result
from protocol.spool import Spool
from protocol.watch import filesystem_type

TARGET_RATIO = 1.25


def fill_done(spool: Spool, count: int) -> None:
    """`count` files in done/, half archived requests and half consumed results, as serving leaves them."""
    body = make_request("old").prompts[0].encode()
    for i in range(count // 2):
        spool.archived_request_path(f"old-{i:07d}").write_bytes(body)
        spool.consumed_result_path(f"old-{i:07d}").write_bytes(body)


def worker_figures(pid: int) -> tuple[float, int]:
    """(CPU seconds, peak resident bytes) of a live process."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    peak = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmHWM"))
    return cpu_s, int(peak.split()[1]) * 1024


def path_cost(base: Path, done_files: int, rounds: int, block: int) -> dict[str, list[float]]:
    """Seconds per request of its path through the spool, per block, on a spool whose done/
    starts empty and one whose done/ starts with `done_files` files, alternating (see (b))."""
    spools = {"empty": Spool(base / "path-empty", create=True), "full": Spool(base / "path-full", create=True)}
    fill_done(spools["full"], done_files)
    seconds: dict[str, list[float]] = {name: [] for name in spools}
    for r in range(rounds):
        for name in ("empty", "full") if r % 2 == 0 else ("full", "empty"):
            spool = spools[name]
            requests = [make_request(f"path-{r:04d}-{i:04d}") for i in range(block)]
            started = time.perf_counter()
            spool.submit_many(requests)
            for entry in spool.pending():
                claim = spool.claim(entry, "bench")
                request = spool.load(claim)
                assert not spool.has_result(request.request_id)
                spool.publish_results([Result(request_id=request.request_id, ok=True, texts=[request.prompts])])
                spool.finish(claim)
            spool.recover_stale()
            for request in requests:
                assert spool.read_result(request.request_id).ok
                spool.consume_result(request.request_id)
            seconds[name].append((time.perf_counter() - started) / block)
    return seconds


def served(spool: Spool, request_id: str) -> bool:
    """One result, consumed by its producer (in done/), ok and with the echo's text."""
    try:
        result = decode_result(spool.consumed_result_path(request_id).read_bytes())
    except FileNotFoundError:
        return False
    return result.ok and result.texts == [make_request(request_id).prompts]


def run(base: Path, name: str, done_files: int, args) -> dict:
    spool = Spool(base / name, create=True)
    fill_done(spool, done_files)
    log_dir = base / f"{name}-logs"
    log_dir.mkdir()
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    ids = [f"{name}-{i:06d}" for i in range(args.requests)]
    with EchoWorkers(spool, args.workers, log_dir, prefix=f"bench-{args.workers}w") as workers:
        cpu_before = [worker_figures(p.pid)[0] for p in workers.procs]
        producers = [
            ctx.Process(target=_produce, args=(str(spool.root), ids[k :: args.producers], args.batch, start, out))
            for k in range(args.producers)
        ]
        for p in producers:
            p.start()
        time.sleep(0.5)  # producers build their requests before the clock starts
        started = time.time()
        start.set()
        reports = [out.get(timeout=1800) for _ in producers]
        for p in producers:
            p.join()
        figures = [worker_figures(p.pid) for p in workers.procs]
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise SystemExit(f"a producer failed: {errors[0]}; worker logs in {log_dir}")
    elapsed = max(r["finished"] for r in reports) - started
    cpu_s = sum(f[0] for f in figures) - sum(cpu_before)
    lost = [i for i in ids if not served(spool, i)]
    leftovers = {state: len(os.listdir(spool.root / state)) for state in ("requests", "claimed", "results")}
    return {
        "done_files_at_start": done_files,
        "done_files_at_end": len(os.listdir(spool.done)),
        "requests": args.requests,
        "rate": args.requests / elapsed,
        "elapsed_s": elapsed,
        "worker_cpu_s_per_1000": 1000 * cpu_s / args.requests,
        "worker_peak_rss_mib": [round(f[1] / 2**20, 1) for f in figures],
        "lost_or_wrong": len(lost),
        "leftovers": leftovers,
        "started": started,
        "spool": spool,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--done-files", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=100, help="requests per submit_many")
    parser.add_argument("--spool-dir", type=Path, default=None, help="base directory (default: a temporary one)")
    parser.add_argument("--path-rounds", type=int, default=40, help="blocks per spool in (b)")
    parser.add_argument("--path-block", type=int, default=50, help="requests per block in (b)")
    parser.add_argument("--full-first", action="store_true", help="run the full spool first (order effects)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="a check of the script: 40 requests, 200 files, 2 workers")
    args = parser.parse_args()
    if args.tiny:
        args.requests, args.done_files, args.workers, args.producers, args.batch = 40, 200, 2, 1, 10
        args.path_rounds, args.path_block = 2, 5

    base = Path(tempfile.mkdtemp(prefix="spool-load-", dir=args.spool_dir))
    try:
        info = machine() | {"fstype": filesystem_type(base), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        if args.full_first:
            full = run(base, "full", args.done_files, args)
            empty = run(base, "empty", 0, args)
        else:
            empty = run(base, "empty", 0, args)
            full = run(base, "full", args.done_files, args)
        spool = full.pop("spool")
        empty.pop("spool")
        path = path_cost(base, args.done_files, args.path_rounds, args.path_block)
        pruning = time.monotonic()
        removed = spool.prune(done_older_than_s=time.time() - full["started"])
        prune_s = time.monotonic() - pruning
        left = len(os.listdir(spool.done))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    info["loadavg_end"] = os.getloadavg()[0]
    path_ms = {name: 1e3 * statistics.median(values) for name, values in path.items()}
    ratios = {
        "request_path": path_ms["full"] / path_ms["empty"],
        "peak_rss": max(full["worker_peak_rss_mib"]) / max(empty["worker_peak_rss_mib"]),
    }
    noisy = {
        "cpu_per_request": full["worker_cpu_s_per_1000"] / empty["worker_cpu_s_per_1000"],
        "rate": empty["rate"] / full["rate"],
    }
    for name, figures in (("done/ empty at start", empty), ("done/ full at start", full)):
        print(
            f"{name}: {figures['done_files_at_start']} -> {figures['done_files_at_end']} files in done/; "
            f"{figures['rate']:.0f} requests/s ({figures['elapsed_s']:.1f} s); workers' CPU "
            f"{figures['worker_cpu_s_per_1000']:.2f} s per 1000 requests; "
            f"peak RSS {figures['worker_peak_rss_mib']} MiB; "
            f"lost or wrong {figures['lost_or_wrong']}; left in {figures['leftovers']}"
        )
    print(
        f"prune: removed {removed['done']} files of done/ in {prune_s:.2f} s; "
        f"{left} left (this run's own {2 * args.requests})"
    )
    print(
        f"a request's path, median of {args.path_rounds} blocks of {args.path_block}: "
        f"{path_ms['empty']:.2f} ms with done/ empty, {path_ms['full']:.2f} ms with {args.done_files} files in done/"
    )
    met = all(r <= TARGET_RATIO for r in ratios.values()) and not (empty["lost_or_wrong"] or full["lost_or_wrong"])
    print(f"full / empty: {', '.join(f'{k} {v:.2f} x' for k, v in ratios.items())}; target <= {TARGET_RATIO} x: {met}")
    print(f"full / empty, load-sensitive: {', '.join(f'{k} {v:.2f} x' for k, v in noisy.items())}")
    print(f"machine: {info}; {args.workers} workers, {args.producers} producers, batches of {args.batch}")
    if args.json:
        import json

        figures = {"empty": empty, "full": full, "path_ms": path_ms, "ratios": ratios, "load_sensitive": noisy,
                   "prune_s": prune_s, "pruned": removed, "left": left}  # fmt: skip
        args.json.write_text(
            json.dumps({"machine": info, "figures": figures, "met": met}, indent=1, default=str) + "\n"
        )


if __name__ == "__main__":
    main()
