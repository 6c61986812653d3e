"""What a correct answer is: one definition, used by the trainer's rewards and by eval jobs.

    extract_answer("so the sum is 12.0")   # "12"
    verdict("12", "12.000")                # True: both plain numbers, equal by value
    verdict("x+1", "1+x")                  # None: not decidable here
    is_correct("#### 1,234", "1234")       # True

A completion's answer is, in order: the last number on the line after the last "####" (GSM8K's
answer line); else the content of the last complete \\boxed{...}; else the last number in the
text. Numbers are normalised (commas dropped, a trailing ".0" removed), so "1,234.0" is "1234".

Two answers are equal when their normalised strings are equal, or when both are plain numbers of
equal value (integers exactly, decimals within a relative tolerance). For anything else (algebra,
fractions in LaTeX) this module has no verdict (None): the trainer's Verifier then asks
math-verify for a second opinion, and an eval job counts the answer wrong.

Pure Python with no dependency, so both services' venvs import it.
"""

from __future__ import annotations

import re
from decimal import Decimal

REL_TOL = 1e-6  # decimals this close (relative) are the same answer

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_INTEGER = re.compile(r"-?\d+")
_DECIMAL = re.compile(r"-?\d+\.\d+")
_BOXED = "\\boxed{"


def normalise_number(text: str) -> str:
    """Commas and surrounding space dropped; a zero fraction removed ("1,234.00" -> "1234")."""
    text = text.replace(",", "").strip()
    if re.fullmatch(r"-?\d+\.0*", text):
        text = text.split(".")[0]
    return text


def extract_number(text: str) -> str | None:
    """The last number in `text`, normalised; None when there is none."""
    found = _NUMBER.findall(text)
    return normalise_number(found[-1]) if found else None


def gold_from_answer(answer: str) -> str:
    """The gold number of a GSM8K answer ("... #### 42"); ValueError when it has none."""
    if "####" not in answer:
        raise ValueError("answer has no '#### <number>' line")
    gold = normalise_number(answer.rsplit("####", 1)[1])
    if not _NUMBER.fullmatch(gold):
        raise ValueError(f"the text after '####' is not a number: {gold!r}")
    return gold


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, normalised; None when it has none (see the module)."""
    if "####" in text:
        answer_line = text.rsplit("####", 1)[1].split("\n", 1)[0]
        return extract_number(answer_line)
    boxed = _last_boxed(text)
    if boxed is not None:
        return normalise_answer(boxed)
    return extract_number(text)


def normalise_answer(answer: str) -> str | None:
    """Stripped; plain numbers normalised; None when empty."""
    answer = answer.strip()
    if _NUMBER.fullmatch(answer):
        return normalise_number(answer)
    return answer or None


def as_number(text: str) -> int | Decimal | None:
    """The exact value of a normalised plain number (no float rounding or overflow, however many
    digits a model writes); None for anything else."""
    if _INTEGER.fullmatch(text):
        return int(text)
    if _DECIMAL.fullmatch(text):
        return Decimal(text)
    return None


def verdict(predicted: str | None, gold: str, rel_tol: float = REL_TOL) -> bool | None:
    """True or False when this module can decide; None when neither string equality nor a numeric
    comparison settles it (a second opinion may)."""
    if predicted is None:
        return False
    predicted, gold = normalise_answer(predicted), normalise_answer(gold)
    if predicted is None or gold is None:
        return False
    if predicted == gold:
        return True
    a, b = as_number(predicted), as_number(gold)
    if a is None or b is None:
        return None
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return abs(a - b) <= Decimal(repr(rel_tol)) * max(abs(a), abs(b))


def is_correct(completion: str, gold: str) -> bool:
    """The completion's answer equals `gold` by this module's rules (undecided counts as wrong)."""
    return verdict(extract_answer(completion), gold) is True


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
