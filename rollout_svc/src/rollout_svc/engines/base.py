"""What the worker loop needs from an engine.

An engine serves a batch of requests that share weights and sampling settings in one call and
returns one Completion per request, in order. Request-specific failures (a prompt too long,
weights it cannot load) are raised as RequestFailed (rollout_svc.errors) so the worker can turn
them into error results; anything else is a bug or a broken engine and is reported as
`engine_error`. An engine reports what it is doing (loading, reloading, generating) to the one
listener the worker gives it with `set_state_listener`.

An engine asked to `sleep` gives its device memory back and stays asleep until the next
`ensure_weights` or `generate`, which wakes it (its listener hears "reloading") before it serves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from protocol.messages import Request

EngineState = Literal["loading", "reloading", "generating"]
StateListener = Callable[[EngineState], None]


def ignore_state(state: EngineState) -> None:
    """The listener of an engine nobody listens to."""


@dataclass
class Completion:
    """The engine's answer to one request. Nested as [prompt][sample][token]."""

    texts: list[list[str]]
    token_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]
    finish_reasons: list[list[str]]
    prompt_token_ids: list[list[int]]
    reload_s: float = 0.0  # weight reload or engine build this call needed (0 when already loaded)
    reload_bytes: int = 0  # bytes of the weight files that reload loaded (0 when already loaded)
    # [prompt] prompt tokens the prefix cache served; empty where the engine does not say
    cached_tokens: list[int] = field(default_factory=list)


class Engine(Protocol):
    name: str  # "<engine> <version>", shown in status files and results
    device: str  # "cpu", "cuda:0"...
    weights_dir: str | None  # weights currently loaded, if the engine has any
    weights_content_id: str | None
    build_s: float  # seconds the last engine build took; 0.0 before one, or for engines that build none
    asleep: bool  # True from a sleep() until the load that wakes the engine
    last_wake_s: float  # seconds the last wake took (reloading weights included)

    def set_state_listener(self, listener: StateListener) -> None:
        """Call `listener` with each state the engine enters ("loading", "reloading", "generating")."""
        ...

    def ensure_weights(self, weights_dir: str, expected_content_id: str | None = None) -> float:
        """Load `weights_dir` if it is not what the engine holds; returns the seconds spent.
        Raises RequestFailed for weights it cannot serve."""
        ...

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Serve requests sharing weights_dir (and content id), in one engine call."""
        ...

    def sleep(self) -> float:
        """Give the device memory back until the next load; returns the seconds it took.
        An engine with nothing to free stays awake (`asleep` False) and returns 0.0."""
        ...

    def close(self) -> None:
        """Free the device."""
        ...
