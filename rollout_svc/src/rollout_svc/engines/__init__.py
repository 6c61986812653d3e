"""Engines the worker can serve with, by name. Heavy imports happen only for the one chosen."""

from __future__ import annotations

from .base import Completion, Engine, RequestFailed

ENGINES = ("echo",)


def make_engine(name: str, **options) -> Engine:
    if name == "echo":
        from .echo import EchoEngine

        return EchoEngine()
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")


__all__ = ["Completion", "Engine", "RequestFailed", "ENGINES", "make_engine"]
