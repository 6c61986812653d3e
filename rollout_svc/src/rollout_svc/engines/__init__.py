"""Engines the worker can serve with, by name. Heavy imports happen only for the one chosen."""

from __future__ import annotations

from ..errors import RequestFailed
from .base import Completion, Engine

ENGINES = ("echo", "vllm")


def make_engine(name: str, **options) -> Engine:
    """`options` go to the engine's constructor (see VllmEngine); echo takes none."""
    if name == "echo":
        from .echo import EchoEngine

        return EchoEngine()
    if name == "vllm":
        from .vllm import VllmEngine

        return VllmEngine(**options)
    raise ValueError(f"unknown engine {name!r}; set --engine to one of {', '.join(ENGINES)}")


__all__ = ["Completion", "Engine", "RequestFailed", "ENGINES", "make_engine"]
