"""Spool benchmarks: durable publish, round trip with one echo worker, sustained throughput.

    .venvs/rollout/bin/python -m bench.spool_roundtrip [--requests N] [--spool-dir BASE] [--json OUT]

(a) publish: one durable file publish (write, fsync, link, fsync directory), as a result is
    published, on the spool's filesystem; p50 and p99.
(b) round trip: one echo worker; SpoolClient.submit then wait, sequentially; p50 and p99, and
    where the time goes. Each round trip follows one publish of (a), so that the two figures
    share their minutes: on a shared machine the cost of an fsync drifts with other I/O.
(c) throughput: producers submit N requests in submit_many batches and wait for every result,
    with 1 and with 4 echo workers; rate = N / elapsed.
(d) diagnosis: wake-up latency of protocol.watch.Waker when a file is created in a watched
    directory, alone and right after a move out of that directory.

Targets: p50 round trip <= 5 x p50 durable publish; >= 500 requests/s with 4 workers.
Workers are real `rollout-svc serve --engine echo` processes, started in their own process
groups and stopped (SIGTERM, then SIGKILL) at the end.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench.common import percentile
from bench.workers import EchoWorkers
from protocol import fsio
from protocol.client import SpoolClient
from protocol.messages import Request, Result, encode
from protocol.spool import Spool
from protocol.watch import Waker, filesystem_type

ROUND_TRIP_FACTOR = 5.0  # target: p50 round trip <= this x p50 durable publish
RATE_TARGET = 500.0  # target: requests/s with 4 workers


def make_request(request_id: str) -> Request:
    return Request(
        request_id=request_id,
        weights_dir="/models/echo",
        prompts=[f"prompt of {request_id}"],
        n_samples_per_prompt=1,
        max_tokens=64,
        temperature=0.0,
    )


class Publisher:
    """Times one durable publish of a result-sized file (write, fsync, link, fsync directory),
    exactly as a worker publishes a result, into a directory of its own on the spool's filesystem."""

    def __init__(self, base: Path):
        self.spool = Spool(base / "publish", create=True)
        self.data = encode(Result(request_id="r" * 20, ok=True, texts=[["x" * 200]], token_ids=[[list(range(64))]]))
        self.times: list[float] = []

    def once(self) -> None:
        final = self.spool.results / f"p{len(self.times):06d}.json"
        started = time.perf_counter()
        fsio.publish(self.spool.tmp, final, self.data)
        self.times.append(time.perf_counter() - started)


SEGMENTS = (
    ("submit", "producer's submit(): request written, fsynced, linked, directory fsynced"),
    (
        "serve",
        "submit() returned -> result built: worker wake-up, scan, claim, load, echo "
        "(< 0: the worker saw the link while submit() still fsynced the directory)",
    ),
    ("collect", "result built -> wait() returned: status beat, result publish, producer wake-up, read, consume"),
)


def bench_round_trip(
    base: Path, count: int, log_dir: Path, publisher: Publisher, warm_up: int = 20
) -> tuple[list[float], dict[str, list[float]]]:
    """Round-trip seconds, and where they went (wall clocks of the producer and of the worker,
    which stamps `finished_at` when it builds the result; one machine, so one clock).

    Each round trip is preceded by one timed durable publish, so that both figures come from the
    same minutes: on a shared machine the cost of an fsync drifts with other tenants' I/O."""
    spool = Spool(base / "roundtrip", create=True)
    times, segments = [], {name: [] for name, _ in SEGMENTS}
    with EchoWorkers(spool, 1, log_dir, prefix="bench-1w"), SpoolClient(spool.root, create=False) as client:
        for i in range(count + warm_up):  # the first ones warm up caches and the watchers
            if i >= warm_up:
                publisher.once()
            request = make_request(f"rt-{i:06d}")
            started, wall0 = time.perf_counter(), time.time()
            client.submit(request)
            submitted = time.time()
            result = client.wait([request.request_id], timeout_s=30)[request.request_id]
            elapsed, wall1 = time.perf_counter() - started, time.time()
            assert result.ok and result.texts == [[request.prompts[0]]], result
            if i < warm_up:
                continue
            times.append(elapsed)
            segments["submit"].append(submitted - wall0)
            segments["serve"].append(result.finished_at - submitted)
            segments["collect"].append(wall1 - result.finished_at)
    return times, segments


def bench_wake(base: Path, count: int) -> dict[str, list[float]]:
    """Seconds from creating a file in a watched directory until protocol.watch.Waker.wait
    returns: on its own, and right after another file was moved out of that directory (what
    every claim does to requests/ and every consume to results/)."""
    watched, elsewhere = base / "wake" / "watched", base / "wake" / "elsewhere"
    watched.mkdir(parents=True)
    elsewhere.mkdir()
    out: dict[str, list[float]] = {"create": [], "create after a move out": []}
    with Waker([watched]) as waker:
        time.sleep(0.2)
        for case, times in out.items():
            for i in range(count):
                if case != "create":
                    (watched / f"moved-{i}").write_bytes(b"{}")
                    time.sleep(0.05)  # its events are out: forget them
                    waker.wait(0)
                    os.rename(watched / f"moved-{i}", elsewhere / f"moved-{i}")
                started = time.perf_counter()
                os.close(
                    os.open(watched / f"{case.replace(' ', '-')}-{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                )
                woke = waker.wait(5.0)
                times.append(time.perf_counter() - started if woke else float("inf"))
                time.sleep(0.6)  # let delayed events drain, then forget them
                waker.wait(0)
    return out


def _produce(root: str, ids: list[str], batch: int, start, out) -> None:
    """One producer process: submit its ids in batches, then wait for all of them."""
    try:
        with SpoolClient(root, create=False) as client:
            requests = [make_request(i) for i in ids]
            start.wait()
            t0 = time.time()
            for k in range(0, len(requests), batch):
                client.submit_many(requests[k : k + batch])
            submitted = time.time()
            results = client.wait(ids, timeout_s=600)
            finished = time.time()
    except Exception as exc:  # reported to the parent, which would otherwise wait for nothing
        out.put({"error": f"{type(exc).__name__}: {exc}"})
        return
    bad = [i for i, r in results.items() if not r.ok]
    out.put({"t0": t0, "submitted": submitted, "finished": finished, "bad": len(bad)})


def bench_rate(base: Path, n: int, workers: int, producers: int, batch: int, log_dir: Path) -> dict:
    spool = Spool(base / f"rate-{workers}w", create=True)
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    ids = [f"tp{workers}-{i:06d}" for i in range(n)]
    shares = [ids[p::producers] for p in range(producers)]
    with EchoWorkers(spool, workers, log_dir, prefix=f"bench-{workers}w"):
        procs = [ctx.Process(target=_produce, args=(str(spool.root), share, batch, start, out)) for share in shares]
        for p in procs:
            p.start()
        time.sleep(0.5)  # let producers build their requests before the clock starts
        t0 = time.time()
        start.set()
        reports = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise SystemExit(f"a producer failed: {errors[0]}; worker logs in {log_dir}")
    elapsed = max(r["finished"] for r in reports) - t0
    submit_s = max(r["submitted"] for r in reports) - t0
    assert sum(r["bad"] for r in reports) == 0
    return {"workers": workers, "producers": producers, "requests": n, "batch": batch,
            "elapsed_s": elapsed, "submit_s": submit_s, "rate": n / elapsed}  # fmt: skip


def machine() -> dict:
    return common.machine() | {"kernel": platform.release(), "loadavg_start": os.getloadavg()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per throughput run (default 3000)")
    parser.add_argument(
        "--round-trips",
        type=int,
        default=300,
        help="sequential round trips, each preceded by one timed durable publish (default 300)",
    )
    parser.add_argument("--wake-samples", type=int, default=10, help="wake-up latencies timed per case (default 10)")
    parser.add_argument(
        "--producers", type=int, default=2, help="producer processes in the throughput runs (default 2)"
    )
    parser.add_argument("--batch", type=int, default=100, help="requests per submit_many (default 100)")
    parser.add_argument(
        "--spool-dir",
        type=Path,
        default=None,
        help="base directory for the spools (default: a new temporary directory)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the spools and worker logs")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: a few of each, 1 and 2 workers")
    args = parser.parse_args()
    workers = (1, 4)
    if args.tiny:
        args.requests, args.round_trips, args.wake_samples, args.producers, args.batch = 40, 5, 1, 1, 10
        workers = (1, 2)

    if args.spool_dir is not None:
        args.spool_dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="spool-bench-", dir=args.spool_dir))
    log_dir = base / "logs"
    log_dir.mkdir()
    info = machine() | {"spool_dir": str(base), "fstype": filesystem_type(base),
                        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}  # fmt: skip
    print(
        f"spool base {base} ({info['fstype']}), {info['cores']} cpus {info['cpu']}, python {info['python']}, "
        f"load average {info['loadavg_start']:.2f}"
    )
    try:
        publisher = Publisher(base)
        round_trip, segments = bench_round_trip(base, args.round_trips, log_dir, publisher, 2 if args.tiny else 20)
        publish = publisher.times
        print(f"(a) durable publish and (b) round trip: {len(round_trip)} of each done")
        rates = [bench_rate(base, args.requests, w, args.producers, args.batch, log_dir) for w in workers]
        print("(c) throughput: done")
        wake = bench_wake(base, args.wake_samples)
        print("(d) wake-up latency: done")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)

    pub50, pub99 = percentile(publish, 50), percentile(publish, 99)
    rt50, rt99 = percentile(round_trip, 50), percentile(round_trip, 99)
    rate1, rate4 = rates[0]["rate"], rates[1]["rate"]
    rt_limit = ROUND_TRIP_FACTOR * pub50
    rows = [
        ("durable publish p50", f"{pub50 * 1e3:.2f} ms", "", ""),
        ("durable publish p99", f"{pub99 * 1e3:.2f} ms", "", ""),
        ("round trip p50 (1 worker)", f"{rt50 * 1e3:.2f} ms", f"<= {rt_limit * 1e3:.2f} ms (5 x publish)",
         f"{'yes' if rt50 <= rt_limit else 'no'} ({rt50 / pub50:.1f} x publish)"),
        ("round trip p99 (1 worker)", f"{rt99 * 1e3:.2f} ms", "", f"{rt99 / pub50:.1f} x publish"),
        ("round trip mean (1 worker)", f"{statistics.fmean(round_trip) * 1e3:.2f} ms", "", ""),
        ("throughput, 1 worker", f"{rate1:.0f} req/s", "",
         f"submit {rates[0]['submit_s']:.2f} s of {rates[0]['elapsed_s']:.2f} s"),
        (f"throughput, {workers[1]} workers", f"{rate4:.0f} req/s", f">= {RATE_TARGET:.0f} req/s",
         f"{'yes' if rate4 >= RATE_TARGET else 'no'} ({rate4 / RATE_TARGET:.2f} x target); "
         f"submit {rates[1]['submit_s']:.2f} s of {rates[1]['elapsed_s']:.2f} s"),
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in rows + [("figure", "value", "target", "met?")]) for i in range(4)]
    print()
    for row in [("figure", "value", "target", "met?"), tuple("-" * w for w in widths)] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip())
    print("\nwhere a round trip's time goes (p50 and p99 of each segment; clocks of two processes):")
    for name, what in SEGMENTS:
        values = segments[name]
        print(
            f"  {name:8} p50 {percentile(values, 50) * 1e3:7.2f} ms  p99 {percentile(values, 99) * 1e3:7.2f} ms  {what}"
        )
    print("\nprotocol.watch.Waker wake-up latency, file created in a watched directory (p50, max):")
    for case, values in wake.items():
        print(f"  {case:26} p50 {percentile(values, 50) * 1e3:7.2f} ms  max {max(values) * 1e3:7.2f} ms")
    info["loadavg_end"] = os.getloadavg()[0]
    print(
        f"\nthroughput runs: {args.requests} requests, {args.producers} "
        f"producer processes, submit_many batches of {args.batch}"
    )
    print(f"load average (1 min) at start {info['loadavg_start']:.2f}, at end {info['loadavg_end']:.2f}")

    if args.json is not None:
        figures = {
            "machine": info,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "publish_s": {"p50": pub50, "p99": pub99, "n": len(publish)},
            "round_trip_s": {"p50": rt50, "p99": rt99, "mean": statistics.fmean(round_trip), "n": len(round_trip)},
            "round_trip_segments_s": {
                name: {"p50": percentile(v, 50), "p99": percentile(v, 99)} for name, v in segments.items()
            },
            "throughput": rates,
            "wake_s": {case: {"p50": percentile(v, 50), "max": max(v)} for case, v in wake.items()},
            "targets": {"round_trip_p50_max_s": rt_limit, "round_trip_met": rt50 <= rt_limit,
                        "rate_4_workers_min": RATE_TARGET, "rate_met": rate4 >= RATE_TARGET},
        }  # fmt: skip
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
