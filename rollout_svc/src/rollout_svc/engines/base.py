"""What the worker loop needs from an engine.

An engine serves a batch of requests that share weights and sampling settings in one call and
returns one Completion per request, in order. Request-specific failures (a prompt too long,
weights it cannot load) are raised as RequestFailed so the worker can turn them into error
results; anything else is a bug or a broken engine and is reported as `engine_error`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from protocol.messages import ErrorCode, Request


class RequestFailed(Exception):
    """A request this engine cannot serve; becomes an error result with `code`."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Completion:
    """The engine's answer to one request. Nested as [prompt][sample][token]."""

    texts: list[list[str]]
    token_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]
    finish_reasons: list[list[str]]
    prompt_token_ids: list[list[int]]
    reload_s: float = 0.0  # weight reload this call needed
    extra: dict = field(default_factory=dict)


class Engine(Protocol):
    name: str  # "<engine> <version>", shown in status files and results
    device: str  # "cpu", "cuda:0"...
    weights_dir: str | None  # weights currently loaded, if the engine has any
    weights_content_id: str | None

    def ensure_weights(self, weights_dir: str, expected_content_id: str | None = None) -> float:
        """Load `weights_dir` if it is not what the engine holds; returns the seconds spent.
        Raises RequestFailed for weights it cannot serve."""
        ...

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Serve requests sharing weights_dir (and content id), in one engine call."""
        ...

    def close(self) -> None:
        """Free the device."""
        ...
