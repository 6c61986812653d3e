"""The built-in reward terms and the verifier behind them.

Each built-in is a reward function in the calling convention of trainer_svc.learning.reward_functions
(keyword arguments, one float per completion), named in `reward.functions` by its short name:

    correct    1.0 where the completion's answer equals the row's gold, else 0.0. The answer and
               its equality follow protocol.answers (the one definition of a correct answer,
               which eval jobs use too), with math-verify as a second opinion where that module
               cannot decide (Verifier).
    format     0.0 where the completion ended by itself and is exactly an answer (format_ok),
               else -1.0: a penalty.
    overlong   DAPO's soft overlong penalty of the completion's length, in [-1, 0]
               (overlong_penalty; 0 while reward.overlong_buffer = 0).

With the default weights (1, 0, 1) the reward is exactly 0 or 1 and the shaping terms only
subtract: a correct, well-formed answer that ends well before the token cap earns exactly the
weight of `correct`.

math-verify arms signal.alarm for its own timeouts, which works only on the main thread. Here it
runs with those timeouts off, in a one-worker process pool, under a timeout of our own; a worker
that overruns is killed and replaced, so a pathological answer costs at most `timeout_s`.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing import get_context

from protocol import answers
from protocol.answers import extract_answer

from .reward_process import ignore_stop_signals, kill_pool

ANSWER_FORMAT = r"-?\d+"  # the arithmetic task: digits, maybe a leading minus, nothing else


def format_ok(text: str, finish_reason: str, pattern: str = ANSWER_FORMAT) -> bool:
    """The completion ended by itself (finish_reason "stop") and, stripped, is exactly an answer."""
    return finish_reason == "stop" and re.fullmatch(pattern, text.strip()) is not None


# -- the verifier --------------------------------------------------------------------------------


def _math_verify_installed() -> bool:
    try:
        return importlib.util.find_spec("math_verify") is not None
    except ValueError:  # sys.modules["math_verify"] is None: its import is blocked
        return False


def _math_verify_equal(predicted: str, gold: str) -> bool:
    """math-verify's verdict, with its signal.alarm timeouts off (the caller bounds the time)."""
    from math_verify import parse, verify

    def parsed(answer: str) -> list:
        # Bare LaTeX such as \sqrt{4} parses only between math delimiters.
        return parse(answer if "$" in answer else f"${answer}$", parsing_timeout=None)

    return verify(parsed(gold), parsed(predicted), timeout_seconds=None)


def _prepare_worker() -> None:
    ignore_stop_signals()


def _prepare_math_verify_worker() -> None:
    ignore_stop_signals()
    # math-verify warns on every call that its timeouts are off; that is deliberate here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401  (paid once at start, not inside the first answer's timeout)


def _ready(check: Callable[[str, str], bool]) -> None:
    """Nothing: receiving `check` makes the worker import its module before any timed call."""


class Verifier:
    """Decides whether a predicted answer equals the gold one.

    protocol.answers.verdict decides first: equal strings, or plain numbers compared by value
    (integers exactly, decimals within `rel_tol`). Where it cannot decide, if
    math-verify is installed (and `use_math_verify`), math-verify gives a second opinion in a
    worker process, started on first use; an answer it cannot judge within `timeout_s` counts as
    wrong and increments `timeouts`. Not thread-safe: use one Verifier per thread.

    The worker starts by forkserver, which imports the program's main module: a script that uses
    a second opinion must keep its top-level code under `if __name__ == "__main__":`.
    """

    def __init__(
        self,
        timeout_s: float = 2.0,
        use_math_verify: bool = True,
        rel_tol: float = answers.REL_TOL,
        startup_timeout_s: float = 60.0,
        _second_opinion: Callable[[str, str], bool] | None = None,
    ):
        self.timeout_s = timeout_s
        self.rel_tol = rel_tol
        self.startup_timeout_s = startup_timeout_s
        if _second_opinion is None and use_math_verify and _math_verify_installed():
            _second_opinion = _math_verify_equal
        self._second_opinion = _second_opinion  # module-level function: it is pickled to the worker
        self._pool: ProcessPoolExecutor | None = None
        self.timeouts = 0  # second opinions abandoned at timeout_s
        self.second_opinions = 0  # answers sent to the worker

    def verify(self, predicted: str | None, gold: str) -> bool:
        decided = answers.verdict(predicted, gold, self.rel_tol)
        if decided is not None:
            return decided
        if self._second_opinion is None:
            return False
        return self._ask_worker(answers.normalise_answer(predicted), answers.normalise_answer(gold))

    def is_correct(self, completion: str, gold: str) -> bool:
        """protocol.answers.is_correct, with the second opinion where that module cannot decide."""
        return self.verify(extract_answer(completion), gold)

    def close(self) -> None:
        """Stop the worker process, if one was started. verify() after close() starts a new one."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Verifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ask_worker(self, predicted: str, gold: str) -> bool:
        if self._pool is None:
            self._pool = self._start_pool()
        self.second_opinions += 1
        future = self._pool.submit(self._second_opinion, predicted, gold)
        try:
            return bool(future.result(timeout=self.timeout_s))
        except FutureTimeout:
            self.timeouts += 1
            self._kill_pool()
            return False

    def _start_pool(self) -> ProcessPoolExecutor:
        # forkserver, not fork: the trainer has threads (torch, the spool client), and a child
        # forked from a threaded process can inherit locks that no thread will ever release.
        uses_math_verify = self._second_opinion is _math_verify_equal
        pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=get_context("forkserver"),
            initializer=_prepare_math_verify_worker if uses_math_verify else _prepare_worker,
        )
        pool.submit(_ready, self._second_opinion).result(timeout=self.startup_timeout_s)
        return pool

    def _kill_pool(self) -> None:
        """Kill the stuck worker; the next second opinion starts a fresh pool."""
        pool, self._pool = self._pool, None
        kill_pool(pool)


# -- the built-in reward functions ---------------------------------------------------------------


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), in [-1, 0].

    0 while length <= max_tokens - buffer; then falls linearly, (max_tokens - buffer - length) /
    buffer, reaching -1 at length == max_tokens; -1 beyond. buffer 0 disables it (always 0).
    """
    if not 0 <= buffer <= max_tokens:
        raise ValueError(f"need 0 <= buffer <= max_tokens, got buffer={buffer}, max_tokens={max_tokens}")
    if buffer == 0:
        return 0.0
    if length > max_tokens:
        return -1.0
    return min(0.0, (max_tokens - buffer - length) / buffer)


class CorrectAnswer:
    """The built-in `correct`: 1.0 where a completion's answer equals its row's gold
    (Verifier.is_correct), else 0.0. Every row needs a gold (checked at launch)."""

    def __init__(self, verifier: Verifier):
        self.verifier = verifier

    def __call__(self, completions: list[str], prompts: list, *, gold: list[str], **kwargs) -> list[float]:
        return [float(self.verifier.is_correct(text, answer)) for text, answer in zip(completions, gold, strict=True)]


def format_penalty(completions: list[str], prompts: list, *, finish_reasons: list[str], **kwargs) -> list[float]:
    """The built-in `format`: 0.0 where a completion ended by itself and is exactly an answer
    (format_ok with ANSWER_FORMAT), else -1.0."""
    return [float(format_ok(text, reason)) - 1.0 for text, reason in zip(completions, finish_reasons, strict=True)]


class OverlongPenalty:
    """The built-in `overlong`: overlong_penalty of each completion's length in tokens (the
    end-of-sequence token of one that ended by itself included), in [-1, 0]."""

    def __init__(self, buffer: int):
        self.buffer = buffer

    def __call__(
        self, completions: list[str], prompts: list, *, completion_ids: list[list[int]], max_tokens: int, **kwargs
    ) -> list[float]:
        return [overlong_penalty(len(ids), max_tokens, self.buffer) for ids in completion_ids]
