"""protocol.answers: the one definition of a correct answer (eval jobs and the trainer's rewards)."""

from __future__ import annotations

import pytest

from protocol.answers import extract_answer, is_correct, verdict

# -- extract_answer ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("20", "20"),
        ("-3", "-3"),
        (" 7\n", "7"),
        ("0", "0"),
        ("The answer is 1,234.", "1234"),
        ("it is 12.0 apples", "12"),
        ("3 then 4 then 5", "5"),
        ("#### 42", "42"),
        ("3 + 4 = 7\n#### 7\nQuestion: what is 90 + 9?", "7"),
        ("#### 5 and later #### 6", "6"),
        ("#### $1,000.00", "1000"),
        ("99\n#### no number here", None),
        ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{ 2,500 }", "2500"),
        ("\\boxed{2.50}", "2.50"),
        ("\\boxed{x^{2}} and a later \\boxed{3", "x^{2}"),
        ("\\boxed{12", "12"),
        ("\\boxed{ }", None),
        ("", None),
        ("no digits", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# -- verdict and is_correct ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "predicted, gold, expected",
    [
        ("20", "20", True),
        ("21", "20", False),
        ("1,234.0", "1234", True),
        ("0.3333333", "0.333333", True),  # within the relative tolerance
        ("0.33", "0.333333", False),
        (str(10**20 + 1), str(10**20), False),  # integers compare exactly, not as floats
        (None, "1", False),
        ("  ", "1", False),
        ("x+1", "x+1", True),
        ("x+1", "1+x", None),  # undecided here: a second opinion may decide
        ("\\frac{1}{2}", "0.5", None),
    ],
)
def test_verdict(predicted, gold, expected):
    assert verdict(predicted, gold) is expected


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("The answer is 42.", "42", True),
        ("#### 41", "42", False),
        ("3 + 4 = 7\n#### 7\nQuestion: what is 90 + 9?", "7", True),
        ("\\boxed{x+1}", "1+x", False),  # undecided counts as wrong
        ("", "0", False),
    ],
)
def test_is_correct(completion, gold, expected):
    assert is_correct(completion, gold) is expected
