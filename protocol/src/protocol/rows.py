"""Prompt rows from JSONL or Parquet files: what the trainer trains on and eval jobs answer.

    rows = read_rows("train.parquet", RowFormat(system_prompt="Answer with a number."))
    rows[0].prompt   # "What is 2+3?" or [{"role": "system", ...}, {"role": "user", ...}]
    rows[0].gold     # "5" (None where the file has no answer)
    rows[0].fields   # the row's other columns, for reward functions and eval output

Which column is what:
- The prompt is `prompt_field`, or by default the first of "prompt", "messages", "question" that
  the first row has. Its value is plain text, or a conversation: a list of {"role", "content"}
  turns (the format of HF chat datasets and TRL's conversational rows), which the rollout worker
  renders with the model's chat template. A conversation may not end with an assistant turn (the
  policy writes that turn). `template`, when given, builds text prompts from the row's fields
  (`"{question}\\nAnswer:"`).
- The answer is `answer_field`, or by default the first of "gold", "answer", "solution" the first
  row has; a file with none of them has rows without answers (gold None). The gold is what a
  correct completion's final answer is (protocol.answers): the number after "####" of a GSM8K
  answer, else the content of the last \\boxed{...} of a solution, else the text itself; numbers
  are normalised ("1,234.0" -> "1234").
- `system_prompt` adds a system turn to each conversation that has none. `chat` sends text
  prompts as conversations of one user turn, so that they get the chat template (and the system
  prompt) too.

Guarantees: every row has the same shape (the fields the first row chose, of the same kinds:
all text or all conversations); a row that breaks a rule raises RowError naming the file, the
row (the line of a JSONL file, the 1-based row of a Parquet file) and the field, and nothing is
returned (no file is half loaded). The two formats give equal rows for equal content. A row's
id is "<file stem>-<row>". `fields` hold JSON types only (Parquet timestamps become ISO text),
so rows can be written into checkpoints and result files.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from string import Formatter

import msgspec

from . import exit_codes
from .answers import extract_answer, gold_from_answer, normalise_answer, normalise_number
from .jsonl import json_lines

PROMPT_FIELDS = ("prompt", "messages", "question")
ANSWER_FIELDS = ("gold", "answer", "solution")
ROLES_BEFORE_ANSWER = ("system", "user", "tool")


class RowError(ValueError):
    """A prompt file or row that cannot be used; the message names the file, the row and the field."""

    exit_code = exit_codes.USAGE


@dataclass(frozen=True)
class Row:
    id: str
    prompt: str | list[dict]  # text, or a conversation [{"role", "content"}, ...]
    gold: str | None = None  # normalised; None: no answer known
    fields: dict = field(default_factory=dict)  # the row's other columns


@dataclass(frozen=True)
class RowFormat:
    """How rows are read (`read_rows`'s `fmt`), as the trainer's [data] section holds them."""

    prompt_field: str = ""  # "": the first of PROMPT_FIELDS the first row has
    answer_field: str = ""  # "": the first of ANSWER_FIELDS the first row has, if any
    template: str = ""  # "": the prompt field's text as it is
    system_prompt: str = ""
    chat: bool = False  # text prompts as a conversation of one user turn


def read_rows(path: str | Path, fmt: RowFormat | None = None) -> list[Row]:
    """Every row of a JSONL (`.jsonl`, `.json`, `.ndjson`) or Parquet (`.parquet`) file; see the module."""
    path, fmt = Path(path), fmt or RowFormat()
    _check_template(fmt.template)
    records = list(_records(path))
    if not records:
        raise RowError(f"{path}: no rows")
    first_where, first = records[0]
    prompt_key = fmt.prompt_field or _first_present(first, PROMPT_FIELDS, first_where, "prompt")
    answer_key = fmt.answer_field or next((k for k in ANSWER_FIELDS if k in first), "")
    rows = [_row(path, where, record, prompt_key, answer_key, fmt) for where, record in records]
    kinds = {type(row.prompt) for row in rows}
    if len(kinds) > 1:
        text_row = next(where for (where, _), row in zip(records, rows, strict=True) if isinstance(row.prompt, str))
        raise RowError(
            f"{text_row}: field '{prompt_key}' is text, but other rows hold conversations; a file's prompts are "
            "all text or all conversations"
        )
    return rows


def is_conversation(prompt: str | list[dict]) -> bool:
    return not isinstance(prompt, str)


def prompt_fields(prompts: list[str | list[dict]]) -> dict:
    """A request's prompt field for these prompts, as plain data (what msgspec.convert takes into
    a Request): `prompts` for texts, `messages` for conversations, which the worker renders with
    the model's chat template."""
    return {"messages" if is_conversation(prompts[0]) else "prompts": list(prompts)}


# -- reading -------------------------------------------------------------------------------------


def _records(path: Path) -> Iterator[tuple[str, dict]]:
    """("file:row", the row as a dict of JSON types) for each row, in order."""
    if path.suffix == ".parquet":
        yield from _parquet_records(path)
        return
    if path.suffix not in (".jsonl", ".json", ".ndjson"):
        raise RowError(f"{path}: unknown file type '{path.suffix}'; prompt files are .jsonl or .parquet")
    try:
        for _, where, value in json_lines(path, RowError):
            if not isinstance(value, dict):
                raise RowError(f"{where}: expected a JSON object, got {type(value).__name__}")
            yield where, value
    except FileNotFoundError:
        raise RowError(f"{path}: no such file") from None


def _parquet_records(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RowError(f"{path}: reading Parquet needs pyarrow (pip install 'grpo-protocol[parquet]')") from None
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise RowError(f"{path}: no such file") from None
    except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
        raise RowError(f"{path}: not a readable Parquet file ({exc})") from None
    for number, record in enumerate(table.to_pylist(), 1):
        # Timestamps, decimals and bytes as JSON types, as a JSONL file would have held them.
        yield f"{path}:row {number}", msgspec.to_builtins(record)


def _first_present(record: dict, keys: tuple[str, ...], where: str, what: str) -> str:
    for key in keys:
        if key in record:
            return key
    raise RowError(
        f"{where}: no {what} field; expected one of {', '.join(map(repr, keys))} (got {sorted(record)}), or name "
        f"the field with the {what}_field setting"
    )


# -- one row -------------------------------------------------------------------------------------


def _row(path: Path, where: str, record: dict, prompt_key: str, answer_key: str, fmt: RowFormat) -> Row:
    if record.get(prompt_key) is None:  # Parquet holds a field a row lacks as null
        raise RowError(f"{where}: the prompt field '{prompt_key}' is missing or null (the row has {sorted(record)})")
    value = record[prompt_key]
    if isinstance(value, str):
        prompt = _text_prompt(value, record, prompt_key, where, fmt)
    elif isinstance(value, list):
        if fmt.template:
            raise RowError(f"{where}: field '{prompt_key}' is a conversation; a template builds text prompts only")
        prompt = _conversation(value, where, prompt_key)
    else:
        raise RowError(
            f"{where}: field '{prompt_key}' must be text or a list of {{role, content}} turns, "
            f"got {type(value).__name__}"
        )
    if isinstance(prompt, list) and fmt.system_prompt and prompt[0]["role"] != "system":
        prompt = [{"role": "system", "content": fmt.system_prompt}, *prompt]
    gold = _gold(record, answer_key, where) if answer_key else None
    others = {k: v for k, v in record.items() if k not in (prompt_key, answer_key)}
    line = where.rpartition(":")[2].removeprefix("row ")
    return Row(f"{path.stem}-{line}", prompt, gold, others)


def _text_prompt(value: str, record: dict, key: str, where: str, fmt: RowFormat) -> str | list[dict]:
    text = _format(fmt.template, record, where) if fmt.template else value
    if not text.strip():
        raise RowError(f"{where}: field '{key}' is empty")
    if fmt.chat:
        return [{"role": "user", "content": text}]
    if fmt.system_prompt:
        raise RowError(
            f"{where}: field '{key}' is text, and a system prompt goes into conversations; set chat = true to send "
            "text prompts as a user turn"
        )
    return text


def _conversation(turns: list, where: str, key: str) -> list[dict]:
    if not turns:
        raise RowError(f"{where}: field '{key}' is an empty conversation")
    out = []
    for i, turn in enumerate(turns):
        at = f"{where}: field '{key}', turn {i}"
        if not isinstance(turn, dict):
            raise RowError(f"{at}: expected an object with 'role' and 'content', got {type(turn).__name__}")
        extra = sorted(k for k, v in turn.items() if k not in ("role", "content") and v is not None)
        if extra:
            raise RowError(f"{at}: unexpected keys {extra}; a turn has 'role' and 'content' only")
        role, content = turn.get("role"), turn.get("content")
        if not isinstance(role, str) or not role:
            raise RowError(f"{at}: 'role' must be a non-empty string, got {role!r}")
        if not isinstance(content, str):
            raise RowError(f"{at}: 'content' must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    if out[-1]["role"] not in ROLES_BEFORE_ANSWER:
        raise RowError(
            f"{where}: field '{key}' ends with a '{out[-1]['role']}' turn; the policy writes the answer, so a prompt "
            "ends with a user (or system, tool) turn: drop the last turn, or give it as the answer field"
        )
    return out


def _gold(record: dict, key: str, where: str) -> str:
    if record.get(key) is None:
        raise RowError(f"{where}: the answer field '{key}' is missing or null (the row has {sorted(record)})")
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RowError(f"{where}: field '{key}' must be text or a number, got {type(value).__name__}")
    if not isinstance(value, str):
        return normalise_number(str(value))
    if "####" in value:
        try:
            return gold_from_answer(value)
        except ValueError as exc:
            raise RowError(f"{where}: field '{key}': {exc}") from None
    gold = extract_answer(value) if "\\boxed{" in value else normalise_answer(value)
    if not gold:
        raise RowError(f"{where}: field '{key}' is empty")
    return gold


def _check_template(template: str) -> None:
    try:
        names = [name for _, name, _, _ in Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise RowError(f"template {template!r} is not a format string: {exc}") from None
    if any(not name or not name.isidentifier() for name in names):
        raise RowError(f"template {template!r} must name row fields, as in '{{question}}'")


def _format(template: str, record: dict, where: str) -> str:
    try:
        return template.format_map(record)
    except KeyError as exc:
        raise RowError(f"{where}: the template names field {exc}, which the row lacks (got {sorted(record)})") from None
