"""Times tables written out line by line: a long answer scored by how much of it is right.

A row asks for the multiplication table of `base` from `base x start` to `base x (start + count - 1)`,
one line each ("7 x 3 = 21"). `lines_right` scores a completion by the table's lines it gets right,
less those it gets wrong, over the lines asked, in [0, 1]:

- a line is a product written "a x b = c" (x, X, * or the sign "×"), anywhere in the text;
- right: a = base, b one of the asked factors, c = a * b, each factor counted once;
- wrong: any written product whose c is not a * b, so guessing many lines costs what it gains.

The credit is dense (a completion of 24 lines that gets 18 right scores 0.75, not 0), so a small
model that gets some lines right learns from every group: the task `configs/smollm2-gpu-long.toml`
trains on, answers of a few hundred tokens.
"""

from __future__ import annotations

import re

_PRODUCT = re.compile(r"(\d{1,6})\s*[xX*×]\s*(\d{1,6})\s*=\s*(\d{1,12})")


def score(text: str, base: int, start: int, count: int) -> float:
    """The fraction of the asked lines `text` gets right, less its wrong products, in [0, 1]."""
    asked = set(range(start, start + count))
    right, wrong = set(), 0
    for a, b, c in _PRODUCT.findall(text):
        a, b, c = int(a), int(b), int(c)
        if a * b != c:
            wrong += 1
        elif a == base and b in asked:
            right.add(b)
    return max(0.0, (len(right) - wrong) / count)


def lines_right(completions: list[str], base: list, start: list, count: list, **_) -> list[float]:
    """The reward function (trainer_svc.learning.reward_functions' convention): each completion's
    score against its row's `base`, `start` and `count`."""
    return [score(text, int(b), int(s), int(n)) for text, b, s, n in zip(completions, base, start, count, strict=True)]
