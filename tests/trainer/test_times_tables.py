"""The times-tables task's reward (trainer_svc.tasks.times_tables), on answers worked out by hand
(its rows are checked against their generator with the shipped configs' tests)."""

from __future__ import annotations

from trainer_svc.tasks.times_tables import lines_right, score


def test_every_asked_line_right_scores_one_and_none_scores_zero():
    table = "\n".join(f"7 x {k} = {7 * k}" for k in range(3, 15))
    assert score(table, base=7, start=3, count=12) == 1.0
    assert score("I cannot do that.", base=7, start=3, count=12) == 0.0


def test_a_partly_right_table_scores_its_right_lines_less_its_wrong_ones():
    # 3 x 1..4 asked: 3 right (3 x 1, 3 x 2, 3 x 4), one wrong (3 x 3 = 10), one unasked right (3 x 9).
    text = "3 x 1 = 3\n3 × 2 = 6\n3 x 3 = 10\n3*4=12\n3 x 9 = 27"
    assert score(text, base=3, start=1, count=4) == (3 - 1) / 4


def test_a_line_written_twice_counts_once_and_guessing_does_not_pay():
    assert score("5 x 2 = 10\n5 x 2 = 10", base=5, start=1, count=4) == 1 / 4
    guesses = "\n".join(f"5 x 2 = {c}" for c in range(5, 16))  # one right among eleven
    assert score(guesses, base=5, start=1, count=4) == 0.0


def test_the_reward_function_reads_each_rows_fields():
    completions = ["4 x 1 = 4\n4 x 2 = 8", "9 x 5 = 45"]
    values = lines_right(completions, base=[4, 9], start=[1, 5], count=[2, 2], prompts=["", ""])
    assert values == [1.0, 0.5]
