"""The errors a worker meets: a request it cannot serve (RequestFailed), and the OSErrors of the
spool's files, sorted by what they mean for the worker.

- A full disk or quota (ENOSPC, EDQUOT, EFBIG) fails every write alike: the worker gives its
  claims back and exits CANNOT_WRITE (74).
- A stale handle or an I/O error (ESTALE, EIO) may pass (a network filesystem's server came
  back, a flaky device): the call is tried again a few times, with backoff (`retrying`).
- Any other OSError belongs to one file (a name too long, a file that cannot be moved): that
  file is set aside and the worker serves on.

It imports nothing from this package, so every module of it may import this one.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from protocol.messages import ErrorCode

log = logging.getLogger(__name__)

FULL_DISK = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
TRANSIENT = frozenset({errno.ESTALE, errno.EIO})
RETRY_DELAYS_S = (0.1, 0.3, 1.0, 3.0)  # about 4 s in all, then the error stands for what it is

T = TypeVar("T")


class RequestFailed(Exception):
    """A request this worker cannot serve; becomes an error result with `code`.

    `message` names what is wrong and the request key or worker option to change."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def require_content_id(weights_dir: str, content_id: str, expected: str | None) -> None:
    """A request that names the content id it expects is refused when the directory now holds other
    weights (republished under the same name since the request was written)."""
    if expected is not None and content_id != expected:
        raise RequestFailed(
            ErrorCode.WEIGHTS_INVALID,
            f"weights_dir {weights_dir} has content id {content_id}, the request's weights_content_id "
            f"is {expected}: the directory was replaced since the request was written; "
            "resubmit with the new weights_content_id or without one",
        )


def is_full_disk(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in FULL_DISK


def retrying(call: Callable[[], T], what: str, delays_s: tuple[float, ...] | None = None) -> T:
    """call(), tried again after each of `delays_s` (RETRY_DELAYS_S) while it fails with ESTALE
    or EIO; the last failure is raised. Only for calls that are safe to repeat."""
    delays_s = RETRY_DELAYS_S if delays_s is None else delays_s
    for delay in delays_s:
        try:
            return call()
        except OSError as exc:
            if exc.errno not in TRANSIENT:
                raise
            log.warning("%s: %s; trying again in %.1f s", what, exc, delay)
            time.sleep(delay)
    try:
        return call()
    except OSError as exc:
        if exc.errno in TRANSIENT:
            log.error("%s: %s, still after %d attempts", what, exc, len(delays_s) + 1)
        raise
