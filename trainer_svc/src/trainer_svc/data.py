"""Training problems: the synthetic arithmetic demo task, JSONL prompt files, a held-out split,
and a resumable prompt stream.

    problems = arithmetic_problems(0, 20, "+")        # 441 problems, "3+17=" -> "20"
    train, held_out = split(problems, held_out=41, seed=0)
    stream = PromptStream(train, seed=0)
    batch = stream.take(16)
    state = stream.state_dict()                        # JSON-serialisable; store with a checkpoint

A problem's `gold` is normalised as protocol.answers.normalise_number does (commas and a
trailing ".0" removed), so it compares directly with protocol.answers.extract_answer's output.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from protocol.answers import gold_from_answer, normalise_number
from protocol.jsonl import json_lines

from .config import DataConfig

# op -> (id prefix, function)
OPERATIONS = {"+": ("add", operator.add), "-": ("sub", operator.sub), "*": ("mul", operator.mul)}


class DataError(ValueError):
    """A prompt file that cannot be used; the message names the file and line and what is wrong."""


@dataclass(frozen=True)
class Problem:
    id: str
    # Plain text sent as it is, or a conversation ([{"role", "content"}, ...]) the rollout worker
    # renders with the model's chat template.
    prompt: str | list[dict]
    gold: str | None = None  # normalised as protocol.answers.normalise_number does; None: no answer known
    fields: dict = field(default_factory=dict)  # the row's other fields, for reward functions


# -- the demo task -------------------------------------------------------------------------------


def arithmetic_problems(low: int = 0, high: int = 20, ops: str = "+") -> list[Problem]:
    """Every `a{op}b=` with a and b in [low, high], for each op in `ops` ("+", "-", "*").

    The model must answer with the exact result's digits (a leading minus for negative
    differences) and then end-of-sequence. Order: by op as given, then a, then b; ids such as
    "add-3-17", "sub-0-20", "mul-7-7".
    """
    if not 0 <= low <= high:
        raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")
    if not ops or len(set(ops)) != len(ops) or not set(ops) <= OPERATIONS.keys():
        raise ValueError(f"ops must be distinct characters from {''.join(OPERATIONS)!r}, got {ops!r}")
    numbers = range(low, high + 1)
    problems = []
    for op in ops:
        name, apply = OPERATIONS[op]
        for a in numbers:
            for b in numbers:
                problems.append(Problem(f"{name}-{a}-{b}", f"{a}{op}{b}=", str(apply(a, b))))
    return problems


# -- prompt files --------------------------------------------------------------------------------


def read_gsm8k(path: str | Path, template: str = "{question}") -> list[Problem]:
    """Read a JSONL file of GSM8K rows {"question", "answer": "... #### N"} or {"prompt", "gold"}.

    `template` builds the prompt of GSM8K rows from their question. Blank lines are skipped;
    other keys in a row are ignored. A problem's id is "<file stem>-<line number>". Raises
    DataError, naming file:line, for a row that is not UTF-8, not JSON, not an object, of neither
    shape, or without a usable prompt or gold; and for a file with no rows.
    """
    _check_template(template)
    path = Path(path)
    problems = []
    for number, where, row in json_lines(path, DataError):
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        prompt, gold = _prompt_and_gold(row, template, where)
        problems.append(Problem(f"{path.stem}-{number}", prompt, gold))
    if not problems:
        raise DataError(f"{path}: no rows")
    return problems


def read_prompt_file(path: str | Path, template: str = "{question}") -> list[Problem]:
    """Read a JSONL file of {"prompt", "gold"} rows (GSM8K rows are accepted too, their prompt
    built by `template` from the question). Same rules and errors as read_gsm8k.
    """
    return read_gsm8k(path, template)


def _check_template(template: str) -> None:
    try:
        template.format(question="")
    except (KeyError, IndexError, ValueError) as exc:
        raise DataError(f"data.template {template!r} must use only the field {{question}}: {exc!r}") from None


def _prompt_and_gold(row: dict, template: str, where: str) -> tuple[str, str]:
    is_gsm8k = "question" in row or "answer" in row
    is_plain = "prompt" in row or "gold" in row
    if is_gsm8k and is_plain:
        raise DataError(f"{where}: mixes GSM8K keys (question, answer) with prompt/gold keys")
    if is_gsm8k:
        question = _non_empty_string(row, "question", where)
        answer = _non_empty_string(row, "answer", where)
        try:
            gold = gold_from_answer(answer)
        except ValueError as exc:
            raise DataError(f"{where}: {exc}") from None
        prompt = template.format(question=question)
    elif is_plain:
        prompt = _non_empty_string(row, "prompt", where)
        gold = normalise_number(_gold_text(row, where))
    else:
        raise DataError(f"{where}: expected keys 'question' and 'answer', or 'prompt' and 'gold'; got {sorted(row)}")
    if not gold:
        raise DataError(f"{where}: the gold answer is empty")
    return prompt, gold


def _non_empty_string(row: dict, key: str, where: str) -> str:
    if key not in row:
        raise DataError(f"{where}: missing '{key}'")
    value = row[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: '{key}' is empty")
    return value


def _gold_text(row: dict, where: str) -> str:
    """A gold may be written as a JSON string or number."""
    if "gold" not in row:
        raise DataError(f"{where}: missing 'gold'")
    gold = row["gold"]
    if isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
        raise DataError(f"{where}: 'gold' must be a string or a number, got {type(gold).__name__}")
    return str(gold)


# -- split and stream ----------------------------------------------------------------------------


def split(problems: Sequence[Problem], held_out: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """(train, held_out): `held_out` problems drawn with random.Random(seed), the rest for training.

    Deterministic for a given list and seed; both parts keep the input's order; together they
    are the input. The training part must not be empty.
    """
    if not 0 <= held_out < len(problems):
        raise ValueError(f"held_out must be in [0, {len(problems)}) for {len(problems)} problems, got {held_out}")
    chosen = set(random.Random(seed).sample(range(len(problems)), held_out))
    train = [p for i, p in enumerate(problems) if i not in chosen]
    kept = [p for i, p in enumerate(problems) if i in chosen]
    return train, kept


def load_problems(data: DataConfig, seed: int) -> tuple[list[Problem], list[Problem]]:
    """(training problems, held-out problems) of the [data] section. With a band file, training
    uses its prompts; the held-out ones still come from the task (banding only ever saw training
    problems)."""
    if data.task == "arithmetic":
        problems = arithmetic_problems(data.arithmetic_low, data.arithmetic_high, data.arithmetic_ops)
    else:
        problems = read_prompt_file(data.path, data.template)
    if not data.held_out < len(problems):
        raise DataError(
            f"data.held_out = {data.held_out} leaves no training problem of the {len(problems)} there are; "
            "hold out fewer"
        )
    train_problems, held_out = split(problems, data.held_out, seed)
    if data.band_file:
        if not Path(data.band_file).is_file():
            raise DataError(f"data.band_file {data.band_file} does not exist; make it with `trainer-svc band`")
        train_problems = read_prompt_file(data.band_file)
    return train_problems, held_out


class PromptStream:
    """An endless stream of problems in shuffled epochs; resumable from `state_dict()`.

    Epoch e visits every problem exactly once, in the order random.Random(seed + e) shuffles
    them to. A stream restored with load_state_dict (from the same problem list) continues
    exactly where the saved one stood: the same problems in the same order, across epochs.
    """

    def __init__(self, problems: Sequence[Problem], seed: int = 0):
        if not problems:
            raise ValueError("PromptStream needs at least one problem")
        self._problems = list(problems)
        self._seed = seed
        self._epoch = 0
        self._cursor = 0  # position in the current epoch's order
        self._order = self._shuffled_order()

    @property
    def epoch(self) -> int:
        return self._epoch

    def take(self, n: int) -> list[Problem]:
        """The next n problems (crossing into later epochs as needed)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return [self._next() for _ in range(n)]

    def __iter__(self) -> Iterator[Problem]:
        while True:
            yield self._next()

    def state_dict(self) -> dict:
        """Where the stream stands, as plain JSON types."""
        return {"epoch": self._epoch, "cursor": self._cursor, "seed": self._seed, "size": len(self._problems)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state. The problem list must have the size it had when saved."""
        if state["size"] != len(self._problems):
            raise ValueError(f"state is for {state['size']} problems, this stream has {len(self._problems)}")
        if not 0 <= state["cursor"] <= state["size"] or state["epoch"] < 0:
            raise ValueError(f"state out of range: {state}")
        self._seed = state["seed"]
        self._epoch = state["epoch"]
        self._cursor = state["cursor"]
        self._order = self._shuffled_order()

    def _next(self) -> Problem:
        if self._cursor == len(self._order):
            self._epoch += 1
            self._cursor = 0
            self._order = self._shuffled_order()
        problem = self._problems[self._order[self._cursor]]
        self._cursor += 1
        return problem

    def _shuffled_order(self) -> list[int]:
        order = list(range(len(self._problems)))
        random.Random(self._seed + self._epoch).shuffle(order)
        return order
