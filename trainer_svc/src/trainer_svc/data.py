"""Training problems: the synthetic arithmetic demo task, prompt files (JSONL or Parquet, rows of
text or conversations: protocol.rows), a held-out split, and a resumable prompt stream.

A problem's `gold` is normalised as protocol.answers.normalise_number does (commas and a
trailing ".0" removed), so it compares directly with protocol.answers.extract_answer's output.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from protocol.rows import Row, RowError, RowFormat, is_conversation, read_rows

from .config import DataConfig

# op -> (id prefix, function)
OPERATIONS = {"+": ("add", operator.add), "-": ("sub", operator.sub), "*": ("mul", operator.mul)}


# A prompt file that cannot be used: the message names the file, the row and the field.
DataError = RowError


# A problem is a prompt file's row (id, prompt as text or a conversation the rollout worker renders
# with the model's chat template, normalised gold or None, the other fields for reward functions):
# one type for the trainer, `spoolctl eval` and the prompt files.
Problem = Row


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


def read_prompt_file(path: str | Path, fmt: RowFormat | None = None) -> list[Problem]:
    """The problems of a JSONL or Parquet prompt file (protocol.rows: which field is the prompt,
    which the answer, conversations and their system prompt). Raises DataError naming the file,
    the row and the field; nothing is half loaded."""
    return read_rows(path, fmt or RowFormat())


def row_format(data: DataConfig) -> RowFormat:
    return RowFormat(
        prompt_field=data.prompt_field,
        answer_field=data.answer_field,
        template=data.template,
        system_prompt=data.system_prompt,
        chat=data.chat,
    )


def check_chat_template(problems: Sequence[Problem], tokenizer, model_path: str) -> None:
    """Conversations need the model's chat template; refuse them, naming the first such row,
    where the tokenizer has none (the worker would refuse each request, later and less clearly)."""
    chat = next((p for p in problems if is_conversation(p.prompt)), None)
    if chat is not None and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"row {chat.id} is a conversation, but the model {model_path} has no chat template (in its "
            "tokenizer_config.json or chat_template.jinja); give plain-text `prompt` rows (with data.chat = false "
            "and no data.system_prompt), or train a model that has one"
        )


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
        problems = read_prompt_file(data.path, row_format(data))
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
