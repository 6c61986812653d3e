"""The calculator task (trainer_svc.tasks.calculator): its arithmetic against values worked out
by hand, what it refuses, how it reads an answer, and whole episodes through the episode runner
with a scripted engine: the tool's result comes back as the next environment turn (loss weight
0) and the reward is 1 for the product, +0.1 for having used the tool."""

from __future__ import annotations

from pathlib import Path

import pytest
from local_turns import ScriptedTurns
from test_env_episodes import env_config, run_episodes, tokenizer_of

from trainer_svc.config import load
from trainer_svc.data import load_problems
from trainer_svc.tasks.calculator import evaluate, final_answer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("expression", "value"),
    [("347 * 29", 10063), ("(2 + 3) * 4", 20), ("-7 + 10", 3), ("100 // 7", 14), ("100 % 7", 2), ("12 x 3", 36)],
)
def test_it_works_out_integer_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "only integers"),
        ("2 ** 10", "only integers"),
        ("1.5 * 2", "only integers"),
        ("7 // 0", "division by zero"),
        ("99999999 * 99999999 * 99999999", "a number past"),
        ("1 +" * 100 + "1", "longer than"),
        ("3 *", "not an arithmetic expression"),
    ],
)
def test_it_refuses_what_is_not_integer_arithmetic(expression, why):
    with pytest.raises(ValueError, match=why):
        evaluate(expression)


@pytest.mark.parametrize(
    ("text", "answer"),
    [("Answer: 10,063", 10063), ("so 347 * 29 = 10063.", 10063), ("answer = 5\nthen 7", 5), ("no idea", None)],
)
def test_the_answer_is_the_number_after_answer_else_the_last(text, answer):
    assert final_answer(text) == answer


@pytest.fixture(scope="module")
def row():
    cfg = load(ROOT / "configs" / "smollm2-gpu-tools.toml")
    cfg.data.path = str(ROOT / cfg.data.path)
    return load_problems(cfg.data, cfg.run.seed)[0][0]


def episode(tiny_model, tmp_path, row, answers):
    cfg = env_config(tmp_path, tiny_model, "trainer_svc.tasks.calculator:Calculator", max_turns=3)
    groups = run_episodes(cfg, ScriptedTurns(tokenizer_of(tiny_model), answers), tiny_model, [row])
    return groups[0].samples[0]


def test_a_tool_call_then_the_product_scores_one_and_the_bonus(tiny_model, tmp_path, row):
    a, b = row.fields["a"], row.fields["b"]
    call = f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{a} * {b}"}}}}</tool_call>'
    sample = episode(tiny_model, tmp_path, row, [call, f"Answer: {a * b}"])
    assert (sample.turns, sample.ended, sample.reward) == (2, "done", pytest.approx(1.1))
    environment = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m == 0]
    assert tokenizer_of(tiny_model).decode(environment) == f"<tool_response>{a * b}</tool_response>\n"


def test_the_product_without_the_tool_scores_one_and_a_wrong_answer_nothing(tiny_model, tmp_path, row):
    a, b = row.fields["a"], row.fields["b"]
    assert episode(tiny_model, tmp_path / "right", row, [f"Answer: {a * b}"]).reward == 1.0
    assert episode(tiny_model, tmp_path / "wrong", row, [f"Answer: {a * b + 1}"]).reward == 0.0


def test_a_bad_expression_is_answered_and_the_episode_goes_on(tiny_model, tmp_path, row):
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "2 ** 99"}}</tool_call>'
    sample = episode(tiny_model, tmp_path, row, [call, "Answer: 0"])
    environment = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m == 0]
    assert "only integers" in tokenizer_of(tiny_model).decode(environment)
    assert (sample.turns, sample.reward) == (2, pytest.approx(0.1))


def test_the_worked_example_is_a_call_the_tool_answers_as_shown(row):
    """The example teaches the format the parser reads: its call, run through the environment's
    own tool, gives the example's tool message, and its answer scores as right; the row's question
    comes last."""
    from trainer_svc.envs.api import tool_methods
    from trainer_svc.envs.tools import find_calls, run_calls
    from trainer_svc.tasks.calculator import Calculator

    env = Calculator(row.fields, seed=0)
    system, question, call, result, answer, asked = env.reset()
    assert (system["role"], question["role"], call["role"], result["role"], answer["role"]) == (
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    )
    assert run_calls(find_calls(call["content"]), tool_methods(env)) == [result]
    assert str(final_answer(answer["content"])) == result["content"]
    assert asked == {"role": "user", "content": f"What is {row.fields['a']} * {row.fields['b']}?"}
