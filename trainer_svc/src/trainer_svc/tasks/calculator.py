"""Multiplication with a calculator tool: an environment where the tool is what makes the task
possible. A row asks for the product of a three-digit and a two-digit number ("What is 347 * 29?"),
which a small model rarely gets right alone; the environment offers a `calculate` tool, whose
result comes back as a tool message, and the episode ends with the first assistant turn that
calls no tool. The first messages hold one worked example (a question, its tool call, the tool's
result, the answer) before the row's question: from the instruction alone SmolLM2-135M-Instruct
called the tool in none of 256 sampled episodes; with the example, 59 of 256 call `calculate` and
53 answer right (docs/environments.md): a rate GRPO learns from, and none right without the tool.

Reward (the sum over the episode's turns): 1.0 when that last turn's answer (the number after
"Answer:", else its last number) is the product; 0.1 more when the episode called the tool at
least once, whatever it asked (a denser signal for a model that has yet to learn the format;
it cannot outweigh a right answer). The rows (`scripts/calculator_rows.py`) carry `a`, `b` and
the gold `answer`, so eval jobs grade the last turn the same way.

    [env]
    class = "trainer_svc.tasks.calculator:Calculator"
"""

from __future__ import annotations

import ast
import operator
import re

from ..envs import Environment, Step, tool

TOOL_BONUS = 0.1
MAX_EXPRESSION = 200  # characters: a calculator call, not a program
MAX_MAGNITUDE = 10**15  # no number, given or computed, past this: nothing grows without bound

SYSTEM = (
    "You have a calculator. To use it, write exactly one line such as\n"
    '<tool_call>{"name": "calculate", "arguments": {"expression": "12 * 34"}}</tool_call>\n'
    'and stop: its result comes back to you. Then write "Answer: " and the number.'
)

EXAMPLE = (123, 45)  # the worked example's question
CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "%d * %d"}}</tool_call>'

_ANSWER = re.compile(r"answer\s*[:=]\s*(-?[\d,]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*")
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def evaluate(expression: str) -> int:
    """An integer expression of + - * // % and parentheses; ValueError for anything else (the
    model sees the message as the tool's answer)."""
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.replace("×", "*").replace("x", "*"), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        result = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        result = -_value(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        result = _OPERATORS[type(node.op)](left, right)
    else:
        raise ValueError("only integers, + - * // % and parentheses")
    if abs(result) > MAX_MAGNITUDE:
        raise ValueError(f"a number past {MAX_MAGNITUDE:.0e}")
    return result


def final_answer(text: str) -> int | None:
    """The number after "Answer:", else the text's last number; None when it has none."""
    found = _ANSWER.findall(text) or _NUMBER.findall(text)
    if not found:
        return None
    try:
        return int(found[-1].replace(",", ""))
    except ValueError:
        return None


class Calculator(Environment):
    def __init__(self, row: dict, seed: int):
        self.a, self.b = int(row["a"]), int(row["b"])
        self.used_tool = False

    def reset(self) -> list[dict]:
        a, b = EXAMPLE
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": CALL % (a, b)},
            {"role": "tool", "name": "calculate", "content": str(a * b)},
            {"role": "assistant", "content": f"Answer: {a * b}"},
            {"role": "user", "content": f"What is {self.a} * {self.b}?"},
        ]

    def step(self, text: str) -> Step:
        right = final_answer(text) == self.a * self.b
        return Step(reward=float(right) + (TOOL_BONUS if self.used_tool else 0.0), done=True)

    @tool
    def calculate(self, expression: str) -> int:
        """Work out an arithmetic expression of integers.

        Args:
            expression: integers with + - * // % and parentheses, for example "347 * 29"
        """
        self.used_tool = True
        return evaluate(expression)
