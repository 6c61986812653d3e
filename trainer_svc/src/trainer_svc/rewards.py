"""Rewards: a verifier, format and overlong shaping, and the score of each sample.

    verifier = Verifier()
    rewards = score([("20", "stop", 3), ("2", "length", 4)], gold="20",
                    cfg=RewardConfig(), verifier=verifier, max_tokens=4)
    [r.total for r in rewards]   # [1.0, 0.0]
    verifier.close()

The reward of a sample is

    total = correct * cfg.correct + format_weight * (format_ok - 1) + overlong_weight * overlong

where `correct` follows protocol.answers (the one definition of a correct answer, which eval
jobs use too), with math-verify as a second opinion where that module cannot decide. With the
default RewardConfig (the config's [reward] section) the total is exactly 0 or 1, and the shaping terms only subtract: a
correct, well-formed answer that ends well before the token cap earns exactly `cfg.correct`.

math-verify arms signal.alarm for its own timeouts, which works only on the main thread. Here it
runs with those timeouts off, in a one-worker process pool, under a timeout of our own; a worker
that overruns is killed and replaced, so a pathological answer costs at most `timeout_s`.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from multiprocessing import get_context

from protocol import answers
from protocol.answers import extract_answer

from .config import RewardConfig

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


def _prepare_math_verify_worker() -> None:
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

    @property
    def has_second_opinion(self) -> bool:
        return self._second_opinion is not None

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
            initializer=_prepare_math_verify_worker if uses_math_verify else None,
        )
        pool.submit(_ready, self._second_opinion).result(timeout=self.startup_timeout_s)
        return pool

    def _kill_pool(self) -> None:
        """Kill the stuck worker; the next second opinion starts a fresh pool."""
        pool, self._pool = self._pool, None
        # ProcessPoolExecutor has no public way to stop a running task before Python 3.14.
        processes = list(pool._processes.values())
        for process in processes:
            process.kill()
        for process in processes:
            process.join()
        pool.shutdown(wait=False, cancel_futures=True)


# -- shaping and scoring -------------------------------------------------------------------------


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


@dataclass(frozen=True)
class RewardBreakdown:
    total: float
    correct: bool
    format_ok: bool
    overlong: float  # DAPO's overlong penalty, in [-1, 0], before overlong_weight


def score(
    samples: Sequence[tuple[str, str, int]],
    gold: str,
    cfg: RewardConfig,
    verifier: Verifier,
    max_tokens: int,
    format_pattern: str = ANSWER_FORMAT,
) -> list[RewardBreakdown]:
    """The reward of each sample (text, finish_reason, n_tokens) of one prompt, in order.

    total = cfg.correct * correct + cfg.format_weight * (format_ok - 1)
            + cfg.overlong_weight * overlong_penalty(n_tokens, max_tokens, cfg.overlong_buffer)
    The last term is DAPO's soft overlong punishment (Yu et al. 2025).
    """
    rewards = []
    for text, finish_reason, n_tokens in samples:
        correct = verifier.is_correct(text, gold)
        well_formed = format_ok(text, finish_reason, format_pattern)
        overlong = overlong_penalty(n_tokens, max_tokens, cfg.overlong_buffer)
        total = cfg.correct * correct + cfg.format_weight * (well_formed - 1) + cfg.overlong_weight * overlong
        rewards.append(RewardBreakdown(total, correct, well_formed, overlong))
    return rewards
