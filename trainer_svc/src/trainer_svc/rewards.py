"""Rewards: answer extraction, a verifier, format and overlong shaping, and a ceiling check.

    verifier = Verifier()
    rewards = score([("20", "stop", 3), ("2", "length", 4)], gold="20",
                    cfg=RewardConfig(), verifier=verifier, max_tokens=4)
    [r.total for r in rewards]   # [1.0, 0.0]
    verifier.close()

The reward of a sample is

    total = correct * cfg.correct + format_weight * (format_ok - 1) + overlong_weight * overlong

so with the default RewardConfig it is exactly 0 or 1, and the shaping terms only subtract: a
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
from decimal import Decimal
from multiprocessing import get_context

from protocol.evaluation import extract_number, normalise_number

from .data import Problem

ANSWER_FORMAT = r"-?\d+"  # the arithmetic task: digits, maybe a leading minus, nothing else
_PLAIN_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_INTEGER = re.compile(r"-?\d+")
_DECIMAL = re.compile(r"-?\d+\.\d+")
_BOXED = "\\boxed{"


# -- answers -------------------------------------------------------------------------------------


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, normalised; None when it has none.

    In order: the last number on the line after the last "####" (GSM8K's answer line); else the
    content of the last complete \\boxed{...}; else the last number in the text. Numbers are
    normalised as protocol.evaluation.normalise_number does ("1,234.0" -> "1234"); boxed content
    that is not a plain number is returned stripped, as written.
    """
    if "####" in text:
        answer_line = text.rsplit("####", 1)[1].split("\n", 1)[0]
        return extract_number(answer_line)
    boxed = _last_boxed(text)
    if boxed is not None:
        return _normalise_answer(boxed)
    return extract_number(text)


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} whose braces close, nested braces included."""
    start = text.rfind(_BOXED)
    while start != -1:
        content = _braced_content(text, start + len(_BOXED))
        if content is not None:
            return content
        start = text.rfind(_BOXED, 0, start)
    return None


def _braced_content(text: str, begin: int) -> str | None:
    depth = 1
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None


def _normalise_answer(answer: str) -> str | None:
    """Stripped; plain numbers normalised as protocol.evaluation does; None when empty."""
    answer = answer.strip()
    if _PLAIN_NUMBER.fullmatch(answer):
        return normalise_number(answer)
    return answer or None


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

    Numbers are compared by value (integers exactly, decimals within `rel_tol`), and when both
    sides are plain numbers that verdict is final. Otherwise, if the strings differ and
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
        rel_tol: float = 1e-6,
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
        if predicted is None:
            return False
        predicted, gold = _normalise_answer(predicted), _normalise_answer(gold)
        if predicted is None or gold is None:
            return False
        if predicted == gold:
            return True
        verdict = self._numeric_verdict(predicted, gold)
        if verdict is not None:
            return verdict
        if self._second_opinion is None:
            return False
        return self._ask_worker(predicted, gold)

    def close(self) -> None:
        """Stop the worker process, if one was started. verify() after close() starts a new one."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Verifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _numeric_verdict(self, predicted: str, gold: str) -> bool | None:
        """True or False when both are plain numbers; None when either is not."""
        a, b = _as_number(predicted), _as_number(gold)
        if a is None or b is None:
            return None
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return abs(a - b) <= Decimal(repr(self.rel_tol)) * max(abs(a), abs(b))

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


def _as_number(text: str) -> int | Decimal | None:
    """Exact values (no float rounding or overflow, however many digits a model writes)."""
    if _INTEGER.fullmatch(text):
        return int(text)
    if _DECIMAL.fullmatch(text):
        return Decimal(text)
    return None


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
class RewardConfig:
    correct: float = 1.0  # reward of a correct answer
    format_weight: float = 0.0  # subtracted when the completion is not exactly an answer
    overlong_buffer: int = 0  # DAPO's soft overlong buffer, in tokens; 0 turns it off
    overlong_weight: float = 1.0  # scale of the overlong penalty (which lies in [-1, 0])

    def __post_init__(self):
        # Negative weights would turn the shaping terms into bonuses.
        for name in ("format_weight", "overlong_weight", "overlong_buffer"):
            if getattr(self, name) < 0:
                raise ValueError(f"RewardConfig.{name} must be >= 0, got {getattr(self, name)}")


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
        correct = verifier.verify(extract_answer(text), gold)
        well_formed = format_ok(text, finish_reason, format_pattern)
        overlong = overlong_penalty(n_tokens, max_tokens, cfg.overlong_buffer)
        total = cfg.correct * correct + cfg.format_weight * (well_formed - 1) + cfg.overlong_weight * overlong
        rewards.append(RewardBreakdown(total, correct, well_formed, overlong))
    return rewards


# -- launch gate ---------------------------------------------------------------------------------


def ceiling_check(problems: Sequence[Problem], verifier: Verifier) -> dict:
    """How the scoring path judges a perfect policy and a wrong one, over `problems`.

    A perfect policy writes the gold itself (boxed, \\boxed{gold}, when the gold is not a plain
    number); a wrong one writes gold + 1 for numeric golds (\\boxed{gold+1} otherwise). Each
    completion goes through extract_answer and verifier.verify, as a sample would. A usable
    reward has perfect_rate 1.0 and wrong_rate 0.0.
    Returns {"perfect_rate": float, "wrong_rate": float, "n": int}.
    """
    if not problems:
        raise ValueError("ceiling_check needs at least one problem")
    perfect = sum(verifier.verify(extract_answer(_perfect_completion(p.gold)), p.gold) for p in problems)
    wrong = sum(verifier.verify(extract_answer(_wrong_completion(p.gold)), p.gold) for p in problems)
    n = len(problems)
    return {"perfect_rate": perfect / n, "wrong_rate": wrong / n, "n": n}


def _gold_number(gold: str) -> int | Decimal | None:
    canonical = _normalise_answer(gold)
    return None if canonical is None else _as_number(canonical)


def _perfect_completion(gold: str) -> str:
    return gold if _gold_number(gold) is not None else f"\\boxed{{{gold}}}"


def _wrong_completion(gold: str) -> str:
    number = _gold_number(gold)
    return str(number + 1) if number is not None else f"\\boxed{{{gold}+1}}"
