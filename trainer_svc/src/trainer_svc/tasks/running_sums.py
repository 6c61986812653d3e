"""Running sums worked out step by step: a multi-step arithmetic answer scored step by step.

A row gives a start and a list of addends ("Start at 23. Add 14, then 31, then 22."), and the gold
`answer`, the final total. The model is asked to write one line per step ("23 + 14 = 37",
"37 + 31 = 68", ...) and end with the total, so each step's reasoning is the next step's input.
`steps_right` scores a completion by the steps it gets right over the steps asked, in [0, 1]:

- a sum is written "a + b = c" anywhere in the text;
- step i is right when some written sum has a = the running total before step i, b = addend i
  and c = a + b (the running totals are the row's, not the completion's: a slip is not carried on).

Wrong sums cost nothing: a step is only right with the row's running total in it, which is the
arithmetic asked, so writing sums at random gains nothing. A penalty per wrong line teaches a
small model to write less rather than to add better (docs/BENCHMARKS.md, 512 tokens).

The credit is dense (3 steps right out of 6 scores 0.5), so a small model that gets some steps
right learns from every group. The gold answer is the last number of a right answer, so the
canary's held-out greedy accuracy (protocol.answers) grades the final total: the task
`configs/smollm2-gpu-long.toml` trains on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_SUM = re.compile(r"(\d{1,7})\s*\+\s*(\d{1,7})\s*=\s*(\d{1,8})")


def score(text: str, start: int, addends: Sequence[int]) -> float:
    """The fraction of the asked steps `text` gets right, in [0, 1]."""
    steps, total = {}, start
    for i, addend in enumerate(addends):
        steps.setdefault((total, addend), i)
        total += addend
    right = {steps[(a, b)] for a, b, c in _numbers(text) if a + b == c and (a, b) in steps}
    return len(right) / len(addends)


def _numbers(text: str):
    for a, b, c in _SUM.findall(text):
        yield int(a), int(b), int(c)


def steps_right(completions: list[str], start: list, addends: list, **_) -> list[float]:
    """The reward function (trainer_svc.learning.reward_functions' convention): each completion's
    score against its row's `start` and `addends`."""
    return [
        score(text, int(s), [int(a) for a in adds]) for text, s, adds in zip(completions, start, addends, strict=True)
    ]
