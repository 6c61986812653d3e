"""The error a request can fail with, shared by the weights checks, the engines and the worker.

It imports nothing from this package, so every module of it may import this one.
"""

from __future__ import annotations

from protocol.messages import ErrorCode


class RequestFailed(Exception):
    """A request this worker cannot serve; becomes an error result with `code`.

    `message` names what is wrong and the request key or worker option to change."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
