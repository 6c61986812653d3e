"""The engine of the benchmarks that drive one in their own process: rollout_svc's VllmEngine, or,
in their tiny mode (`--tiny`), a stand-in that starts nothing.

The stand-in is the echo engine (completions echo their prompts) whose loads read every file of the
weights directory named: a load costs the directory's bytes, a second request for the weights held
costs nothing, as in the real engine, so a script's loop, its checks and its report run on real
(if meaningless) figures. vLLM is imported only when the real engine is asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from protocol.messages import Request
from rollout_svc.engines.base import Completion
from rollout_svc.engines.echo import EchoEngine


@dataclass
class FilesRead:
    """What one stand-in load did (the fields of VllmEngine.load's answer the benchmarks read)."""

    seconds: float
    bytes: int


class FileReadingEngine(EchoEngine):
    name = "echo, loads read the weight files"

    def __init__(self) -> None:
        self.weights_dir: str | None = None
        self.weights_content_id: str | None = None

    def load(self, weights_dir: str, expected_content_id: str | None = None) -> FilesRead:
        started, read = time.monotonic(), 0
        for path in sorted(Path(weights_dir).rglob("*")):
            if path.is_file():
                read += len(path.read_bytes())
        self.weights_dir, self.weights_content_id = weights_dir, expected_content_id
        return FilesRead(time.monotonic() - started, read)

    def ensure_weights(self, weights_dir: str, expected_content_id: str | None = None) -> float:
        if (weights_dir, expected_content_id) == (self.weights_dir, self.weights_content_id):
            return 0.0
        return self.load(weights_dir, expected_content_id).seconds

    def generate(self, requests: list[Request]) -> list[Completion]:
        reload_s = self.ensure_weights(requests[0].weights_dir, requests[0].weights_content_id)
        done = super().generate(requests)
        done[0].reload_s = reload_s
        return done


def make_engine(tiny: bool, **settings):
    """VllmEngine(**settings), or with `tiny` the stand-in (which takes no settings)."""
    if tiny:
        return FileReadingEngine()
    from rollout_svc.engines.vllm import VllmEngine

    return VllmEngine(**settings)
