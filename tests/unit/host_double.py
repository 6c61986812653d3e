"""The child of the EngineHost tests: a few commands that answer, refuse, fail, die or linger.

Run by EngineHost as `python -m host_double COMMANDS ANSWERS` (tests/unit on PYTHONPATH)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from protocol.messages import ErrorCode
from rollout_svc.engines.host import SHUTDOWN, serve
from rollout_svc.errors import RequestFailed

LINGER = os.environ.get("HOST_DOUBLE_LINGER") == "1"  # ignore the shutdown command, as a hung engine would


def refuse(message: str):
    raise RequestFailed(ErrorCode.PROMPT_TOO_LONG, message)


def fail(message: str):
    raise ValueError(message)


started: list[subprocess.Popen] = []


def spawn(stray: bool = False) -> int:
    """Start a grandchild that sleeps (as an engine core runs), return its pid. The shutdown ends
    it, as an engine's does, unless it is a `stray`."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if not stray:
        started.append(process)
    return process.pid


def shutdown() -> None:
    if LINGER:
        time.sleep(600)
    for process in started:
        process.terminate()
        process.wait()


if __name__ == "__main__":
    serve(
        {
            "echo": lambda *args: args,
            "refuse": refuse,
            "fail": fail,
            "die": lambda: os._exit(3),
            "sleep": time.sleep,
            "spawn": spawn,
            "pid": os.getpid,
            SHUTDOWN: shutdown,
        },
        sys.argv[1:],
    )
