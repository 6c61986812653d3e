"""The spool on an sshfs mount against local disk, in one run: round trip and 4-worker throughput.

    .venvs/rollout/bin/python -m bench.spool_netfs [--round-trips N] [--requests N] [--json OUT]

The sshfs mount is the tests' (tests/netfs.py): an sshd of its own on a loopback port with
throwaway keys, the caches on (attributes and listings 1 s, names 60 s, absent names 600 s).
Workers on it poll by themselves. For each storage, local first, then sshfs:

(a) round trip: one echo worker; SpoolClient.submit then wait, sequentially; p50 and p99;
(b) throughput: 2 producer processes submit N requests in batches of 100 to 4 echo workers and
    wait for every result; rate = N / elapsed.

Needs /dev/fuse, sshfs, sshd (`apt-get install sshfs openssh-server`). Loopback has no network
latency: the sshfs figures are the cost of FUSE and sftp round trips, a floor for a real network.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.common import percentile
from bench.spool_roundtrip import Publisher, bench_rate, bench_round_trip, machine
from protocol.watch import filesystem_type, needs_polling
from tests.netfs import SshServer, missing_prerequisites, sshfs_mount  # the tests' mount helpers


def bench_storage(base: Path, round_trips: int, requests: int, workers: int = 4, warm_up: int = 20) -> dict:
    log_dir = base / "logs"
    log_dir.mkdir()
    try:
        times, _ = bench_round_trip(base, round_trips, log_dir, Publisher(base), warm_up)
        rate = bench_rate(base, requests, workers, 2, 100, log_dir)
    except BaseException:
        for log in sorted(log_dir.glob("*.log")):  # the base directory goes at exit: show why now
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}", file=sys.stderr)
        raise
    return {
        "fstype": filesystem_type(base),
        "polling": needs_polling(base),
        "round_trip_s": {"p50": percentile(times, 50), "p99": percentile(times, 99), "n": len(times)},
        "throughput_4_workers": rate,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round-trips", type=int, default=200, help="sequential round trips per storage")
    parser.add_argument("--requests", type=int, default=2000, help="requests per throughput run")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    parser.add_argument("--tiny", action="store_true", help="a check of the script: 1 round trip, 20 requests")
    args = parser.parse_args()
    workers, warm_up = 4, 20
    if args.tiny:
        args.round_trips, args.requests, workers, warm_up = 1, 20, 2, 0
    missing = missing_prerequisites("sshfs")
    if missing:
        raise SystemExit(f"cannot mount sshfs: missing {', '.join(missing)} (apt-get install sshfs openssh-server)")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the workers, unmount
    top = Path(tempfile.mkdtemp(prefix="spool-netfs-bench-"))
    info = machine() | {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    figures = {}
    try:
        (top / "local").mkdir()
        figures["local"] = bench_storage(top / "local", args.round_trips, args.requests, workers, warm_up)
        print("local disk: done")
        server = SshServer(top / "sshd").start()
        try:
            (top / "export").mkdir()
            with sshfs_mount(server, top / "export", top / "mnt") as mount:
                figures["sshfs"] = bench_storage(mount, args.round_trips, args.requests, workers, warm_up)
        finally:
            server.stop()
        print("sshfs: done")
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(top, ignore_errors=True)

    local, sshfs = figures["local"], figures["sshfs"]
    print(f"\n{info['cores']} cpus {info['cpu']}, python {info['python']}, {info['date']}")
    print(f"{'figure':34} {'local':>12} {'sshfs':>12} {'sshfs/local':>12}")
    for label, key, unit, scale in (
        ("round trip p50 (1 worker)", ("round_trip_s", "p50"), "ms", 1e3),
        ("round trip p99 (1 worker)", ("round_trip_s", "p99"), "ms", 1e3),
        (f"throughput, {workers} workers", ("throughput_4_workers", "rate"), "req/s", 1.0),
    ):
        a, b = local[key[0]][key[1]] * scale, sshfs[key[0]][key[1]] * scale
        print(f"{label:34} {a:9.1f} {unit:<3}{b:9.1f} {unit:<3}{b / a:11.2f}x")
    print(f"filesystems: local {local['fstype']} (polling {local['polling']}), "
          f"sshfs {sshfs['fstype']} (polling {sshfs['polling']})")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": info, "args": vars(args) | {"json": str(args.json)}, **figures},
                                        indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
