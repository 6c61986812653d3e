"""The spool round trip with an echo worker: start a worker, submit requests, read results.

Run by `make echo-smoke`: a deployment check without a model. Shows, end to end on this machine,
what a producer (the trainer, an eval job) does: submit through the spool, wait with a deadline,
and read each result.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from protocol.client import SpoolClient
from protocol.messages import Request

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def main() -> int:
    spool_dir = ROOT / "runs" / "echo-smoke" / "spool"
    client = SpoolClient(spool_dir)
    worker = subprocess.Popen(
        [
            BIN / "rollout-svc",
            "serve",
            "--spool",
            spool_dir,
            "--engine",
            "echo",
            "--worker-id",
            "demo-echo",
            "--idle-exit",
            "60",
        ],
        start_new_session=True,
    )
    try:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        requests = [
            Request(
                request_id=f"demo-{stamp}-{i}",
                weights_dir="/models/none",
                prompts=[f"What is {i}+{i}?", "Echo me"],
                n_samples_per_prompt=2,
                max_tokens=32,
                temperature=1.0,
                tag="demo",
            )
            for i in range(3)
        ]
        started = time.perf_counter()
        with client:
            client.submit_many(requests)
            results = client.wait([r.request_id for r in requests], timeout_s=60)
        elapsed = time.perf_counter() - started
        for request in requests:
            result = results[request.request_id]
            print(f"{result.request_id}: ok={result.ok} worker={result.worker_id} texts={result.texts}")
        print(f"3 requests served in {elapsed * 1000:.0f} ms through {spool_dir}")
        subprocess.run([BIN / "spoolctl", "stats", "--spool", spool_dir], check=True)
    finally:
        worker.terminate()
        code = worker.wait(timeout=30)
    print(f"worker exited with {code} after SIGTERM")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
