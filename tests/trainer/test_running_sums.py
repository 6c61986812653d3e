"""The running-sums task's reward (trainer_svc.tasks.running_sums), on answers worked out by hand
(its rows are checked against their generator with the shipped configs' tests)."""

from __future__ import annotations

import json
from pathlib import Path

from protocol.answers import extract_answer
from trainer_svc.tasks.running_sums import score, steps_right

ROOT = Path(__file__).resolve().parents[2]


def test_every_step_right_scores_one_and_none_scores_zero():
    worked = "34 + 12 = 46\n46 + 26 = 72\n72 + 42 = 114\nThe total is 114."
    assert score(worked, start=34, addends=[12, 26, 42]) == 1.0
    assert score("I cannot do that.", start=34, addends=[12, 26, 42]) == 0.0


def test_a_slip_is_not_carried_on_and_later_steps_still_count():
    # 72 + 42 written as 115 (wrong); the fourth step from the row's own total, 114 + 10, is right.
    text = "34 + 12 = 46\n46 + 26 = 72\n72 + 42 = 115\n114 + 10 = 124"
    assert score(text, start=34, addends=[12, 26, 42, 10]) == 3 / 4
    # A right sum from the completion's own wrong total scores nothing: 115 is no running total.
    assert score("115 + 10 = 125", start=34, addends=[12, 26, 42, 10]) == 0.0


def test_sums_off_the_chain_and_repeats_gain_nothing():
    guesses = "\n".join(f"{a} + {b} = {a + b}" for a in range(10, 30) for b in (12, 26))
    assert score(guesses, start=34, addends=[12, 26]) == 0.0
    assert score("34 + 12 = 46\n34 + 12 = 46", start=34, addends=[12, 26]) == 1 / 2


def test_the_same_step_twice_in_a_row_counts_each_time():
    # Start 20, add 5 twice: the pairs (20, 5) and (25, 5) are two different steps.
    assert score("20 + 5 = 25\n25 + 5 = 30", start=20, addends=[5, 5]) == 1.0


def test_the_reward_function_reads_each_rows_fields():
    completions = ["10 + 1 = 11\n11 + 2 = 13", "50 + 5 = 55"]
    values = steps_right(completions, start=[10, 50], addends=[[1, 2], [5, 7]], prompts=["", ""])
    assert values == [1.0, 0.5]


def test_a_shipped_rows_gold_answer_is_the_last_number_of_its_worked_answer():
    """The canary grades the final total: a completion that works every step, then names the
    total, is graded right by protocol.answers against the row's gold answer."""
    for line in (ROOT / "configs" / "data" / "running_sums.jsonl").read_text().splitlines()[:50]:
        row = json.loads(line)
        total, lines = row["start"], []
        for addend in row["addends"]:
            lines.append(f"{total} + {addend} = {total + addend}")
            total += addend
        worked = "\n".join(lines) + f"\nThe total is {total}."
        assert score(worked, row["start"], row["addends"]) == 1.0
        assert extract_answer(worked) == row["answer"]
        first = f"{row['start']} + {row['addends'][0]} = {row['start'] + row['addends'][0]}"
        assert first in row["messages"][0]["content"]  # the prompt shows the first step's form
