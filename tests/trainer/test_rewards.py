"""Rewards: format, DAPO's overlong penalty, the built-in reward functions, the verifier
(protocol.answers' verdicts, math-verify in a worker process, timeouts), and its agreement with the
eval jobs' grading."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from protocol import answers
from trainer_svc.learning.rewards import (
    CorrectAnswer,
    OverlongPenalty,
    Verifier,
    format_ok,
    format_penalty,
    overlong_penalty,
)

pytestmark = pytest.mark.timeout(60)


# Stand-ins for math-verify. They run in the verifier's worker process, so they live at module
# level (the worker imports this module to find them).


def slow_when_asked(predicted: str, gold: str) -> bool:
    if predicted == "slow":
        time.sleep(30)
    return True


def always_equal(predicted: str, gold: str) -> bool:
    return True


def signalled_as_by_ctrl_c_and_stop(predicted: str, gold: str) -> bool:
    """Sends itself what Ctrl-C and `systemctl stop` send the trainer's whole process group."""
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
    return True


def broken_checker(predicted: str, gold: str) -> bool:
    raise ArithmeticError(f"cannot judge {predicted!r}")


class RejectsEverything(Verifier):
    def verify(self, predicted, gold):
        return False


class AcceptsEverything(Verifier):
    def verify(self, predicted, gold):
        return True


@pytest.fixture
def numeric_verifier():
    with Verifier(use_math_verify=False) as verifier:
        yield verifier


# -- format_ok -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, finish_reason, expected",
    [
        ("20", "stop", True),
        ("-3", "stop", True),
        (" 20\n", "stop", True),
        ("20", "length", False),
        ("20", "abort", False),
        ("", "stop", False),
        ("20 apples", "stop", False),
        ("2-0", "stop", False),
        ("+5", "stop", False),
        ("1.5", "stop", False),
    ],
)
def test_format_ok_default_is_a_bare_integer_that_ended_by_itself(text, finish_reason, expected):
    assert format_ok(text, finish_reason) is expected


def test_format_ok_takes_another_pattern():
    assert format_ok("work\n#### 12", "stop", pattern=r"(?s).*#### -?\d+")
    assert not format_ok("12", "stop", pattern=r"(?s).*#### -?\d+")


# -- overlong_penalty ----------------------------------------------------------------------------


def dapo_reference(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO eq. 13, written out case by case."""
    if length <= max_tokens - buffer:
        return 0.0
    if length <= max_tokens:
        return ((max_tokens - buffer) - length) / buffer
    return -1.0


@pytest.mark.parametrize(
    "length, expected", [(0, 0.0), (15, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (19, -0.75), (20, -1.0), (21, -1.0)]
)
def test_overlong_penalty_at_the_boundaries(length, expected):
    assert overlong_penalty(length, max_tokens=20, buffer=4) == expected
    assert overlong_penalty(length, max_tokens=20, buffer=4) == dapo_reference(length, 20, 4)


def test_overlong_penalty_buffer_zero_disables_it():
    assert [overlong_penalty(n, max_tokens=4, buffer=0) for n in (0, 4, 5, 100)] == [0.0] * 4


def test_overlong_penalty_buffer_as_long_as_the_cap():
    assert [overlong_penalty(n, max_tokens=4, buffer=4) for n in range(6)] == [0.0, -0.25, -0.5, -0.75, -1.0, -1.0]


@pytest.mark.parametrize("buffer", [-1, 5])
def test_overlong_penalty_rejects_buffers_outside_the_cap(buffer):
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(1, max_tokens=4, buffer=buffer)


# -- the built-ins as reward functions -----------------------------------------------------------


def test_the_built_ins_follow_the_calling_convention(numeric_verifier):
    completions = ["20", "21", "20", "so 20", ""]
    arguments = {
        "completions": completions,
        "prompts": ["19+1="] * 5,
        "gold": ["20"] * 5,
        "finish_reasons": ["stop", "stop", "length", "stop", "length"],
        "completion_ids": [[1, 2, 0], [1, 2, 0], [1, 2, 3, 4], [1] * 6, [1] * 5],
        "max_tokens": 4,
        "a_field_they_ignore": [None] * 5,
    }
    assert CorrectAnswer(numeric_verifier)(**arguments) == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert format_penalty(**arguments) == [0.0, 0.0, -1.0, -1.0, -1.0]
    assert OverlongPenalty(2)(**arguments) == [-0.5, -0.5, -1.0, -1.0, -1.0]  # lengths 3, 3, 4, 6, 5 of 4
    assert OverlongPenalty(0)(**arguments) == [0.0] * 5


# -- Verifier: numbers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "predicted, gold, expected",
    [
        ("20", "20", True),
        ("21", "20", False),
        ("-9", "-9", True),
        ("9", "-9", False),
        ("-0", "0", True),
        ("1,234.0", "1234", True),
        ("4.0", "4", True),
        ("4.5", "4", False),
        ("0.3333333", "0.333333", True),  # within the relative tolerance
        ("0.33", "0.333333", False),
        (str(10**20 + 1), str(10**20), False),  # integers compare exactly, not as floats
        ("9" * 400, "1.5", False),  # no float overflow
        ("9" * 400 + ".5", "9" * 400, True),
        ("2.5000001", "2.5", True),
        ("2.51", "2.5", False),
        (None, "1", False),
        ("", "1", False),
        ("  ", "", False),
        ("x+1", "x+1", True),  # equal strings need no second opinion
        ("\\frac{1}{2}", "0.5", False),  # needs math-verify, which this verifier does not use
    ],
)
def test_numeric_verdicts(numeric_verifier, predicted, gold, expected):
    assert numeric_verifier.verify(predicted, gold) is expected
    assert numeric_verifier.second_opinions == 0


def test_plain_numbers_never_go_to_the_worker():
    with Verifier(_second_opinion=always_equal) as verifier:
        assert not verifier.verify("3", "4")
        assert not verifier.verify("3.5", "4")
        assert verifier.second_opinions == 0


# -- Verifier: the second opinion ----------------------------------------------------------------


def test_math_verify_gives_a_second_opinion():
    pytest.importorskip("math_verify")
    with Verifier() as verifier:
        assert verifier.verify("\\frac{1}{2}", "0.5")
        assert not verifier.verify("\\frac{1}{3}", "0.5")
        assert verifier.verify("\\sqrt{4}", "2")
        assert verifier.second_opinions == 3 and verifier.timeouts == 0


def test_without_math_verify_installed_it_is_numeric_only(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now fails
    with Verifier() as verifier:
        assert not verifier.verify("\\frac{1}{2}", "0.5")
        assert verifier.verify("4.0", "4")
        assert verifier.second_opinions == 0


def test_math_verify_can_be_turned_off():
    with Verifier(use_math_verify=False) as verifier:
        assert not verifier.verify("\\frac{1}{2}", "0.5")  # math-verify would say yes
        assert verifier.second_opinions == 0


def test_a_slow_second_opinion_times_out_and_the_worker_is_replaced():
    with Verifier(timeout_s=0.5, _second_opinion=slow_when_asked) as verifier:
        assert verifier.verify("quick", "x")  # starts the worker outside the timed call
        started = time.monotonic()
        assert verifier.verify("slow", "x") is False
        elapsed = time.monotonic() - started
        # Abandoned at the timeout: far less than the 30 s the stuck answer takes (the margin is
        # for killing and joining the worker on a loaded machine).
        assert 0.5 <= elapsed < 5
        assert verifier.timeouts == 1
        assert verifier.verify("quick", "x")  # a fresh worker answers
        assert verifier.timeouts == 1 and verifier.second_opinions == 3


def test_the_second_opinion_worker_outlives_the_signals_that_stop_the_trainer():
    """The trainer stops at a step boundary and may still need its verifier on the way."""
    with Verifier(_second_opinion=signalled_as_by_ctrl_c_and_stop) as verifier:
        assert verifier.verify("y", "x")
        assert verifier.verify("z", "x")
        assert verifier.second_opinions == 2 and verifier.timeouts == 0


def test_errors_of_the_second_opinion_propagate():
    with Verifier(_second_opinion=broken_checker) as verifier:
        with pytest.raises(ArithmeticError, match="cannot judge 'y'"):
            verifier.verify("y", "x")


def test_close_is_idempotent_and_the_verifier_still_works_after_it():
    verifier = Verifier(_second_opinion=always_equal)
    verifier.close()
    assert verifier.verify("y", "x")
    verifier.close()
    verifier.close()
    assert verifier.verify("y", "x")
    verifier.close()


# -- one definition of a correct answer ----------------------------------------------------------


@pytest.mark.parametrize(
    "completion, gold",
    [
        ("20", "20"),
        ("so 12.0", "12"),
        ("#### 1,234", "1234"),
        ("\\boxed{2.5000001}", "2.5"),
        ("the answer is 7\n#### 8", "7"),
        ("\\boxed{x+1}", "x+1"),
        ("no answer", "3"),
        ("3 then 4", "3"),
    ],
)
def test_rewards_and_eval_jobs_agree_where_no_second_opinion_is_needed(numeric_verifier, completion, gold):
    assert numeric_verifier.is_correct(completion, gold) is answers.is_correct(completion, gold)
