"""Prompt rows (protocol.rows), from the user's side: real JSONL and Parquet files, each field
rule and each bad row with the message that names the file, the row and the field."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.rows import Row, RowError, RowFormat, read_rows


def write_jsonl(path, rows) -> str:
    """Rows as JSON lines (strings are written as they are, for broken lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def chat(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in turns]


# -- which field is what ---------------------------------------------------------------------------


def test_gsm8k_rows_give_the_question_and_the_number_after_the_hashes(tmp_path):
    path = write_jsonl(
        tmp_path / "gsm8k.jsonl",
        [
            {"question": "How many?", "answer": "3 * 4 = 12\n#### 1,234"},
            "",
            {"question": "And?", "answer": "#### 42.0"},
        ],
    )
    assert read_rows(path) == [Row("gsm8k-1", "How many?", "1234"), Row("gsm8k-3", "And?", "42")]


def test_a_template_builds_text_prompts_from_any_fields(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "2+3?", "unit": "apples", "answer": "#### 5"}])
    (row,) = read_rows(path, RowFormat(template="Q: {question} ({unit})\nA:"))
    assert (row.prompt, row.gold, row.fields) == ("Q: 2+3? (apples)\nA:", "5", {"unit": "apples"})


@pytest.mark.parametrize(
    "answer, gold",
    [
        (4, "4"),
        (" 1,000 ", "1000"),
        ("0.5", "0.5"),
        ("so #### 7", "7"),
        ("The area is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("x^2 + 1", "x^2 + 1"),
    ],
)
def test_the_gold_is_what_a_correct_final_answer_is(tmp_path, answer, gold):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "gold": answer}])
    assert read_rows(path)[0].gold == gold


@pytest.mark.parametrize("answer_key", ["gold", "answer", "solution"])
def test_default_answer_fields(tmp_path, answer_key):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", answer_key: "12"}])
    assert read_rows(path)[0].gold == "12"


def test_rows_without_an_answer_field_have_no_gold_and_keep_their_fields(tmp_path):
    path = write_jsonl(tmp_path / "open.jsonl", [{"prompt": "Write a haiku", "topic": "sea", "min_words": 5}])
    assert read_rows(path) == [Row("open-1", "Write a haiku", None, {"topic": "sea", "min_words": 5})]


def test_named_fields_override_the_defaults(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"problem": "1+1?", "prompt": "ignored", "target": 2, "answer": "x"}])
    (row,) = read_rows(path, RowFormat(prompt_field="problem", answer_field="target"))
    assert (row.prompt, row.gold, row.fields) == ("1+1?", "2", {"prompt": "ignored", "answer": "x"})


def test_conversations_keep_their_turns_and_get_the_system_prompt_once(tmp_path):
    rows = [
        {"messages": chat(("user", "2+2?")), "answer": "4"},
        {"messages": chat(("system", "Be terse."), ("user", "3+3?")), "answer": "6"},
    ]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    got = read_rows(path, RowFormat(system_prompt="Answer with a number."))
    assert [r.prompt for r in got] == [
        chat(("system", "Answer with a number."), ("user", "2+2?")),
        chat(("system", "Be terse."), ("user", "3+3?")),  # the row's own system turn is kept, not doubled
    ]


def test_trl_conversational_prompts_are_read_from_the_prompt_field(tmp_path):
    path = write_jsonl(tmp_path / "trl.jsonl", [{"prompt": chat(("user", "Hi")), "solution": "\\boxed{3}"}])
    assert read_rows(path) == [Row("trl-1", chat(("user", "Hi")), "3")]


def test_chat_sends_text_prompts_as_a_user_turn_after_the_system_prompt(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "5+5?", "answer": "#### 10"}])
    (row,) = read_rows(path, RowFormat(chat=True, system_prompt="Answer with a number."))
    assert row.prompt == chat(("system", "Answer with a number."), ("user", "5+5?"))


def test_turn_keys_holding_null_are_dropped(tmp_path):
    """HF datasets with several conversation shapes fill absent keys with null."""
    turn = {"role": "user", "content": "hi", "tool_calls": None}
    path = write_jsonl(tmp_path / "n.jsonl", [{"messages": [turn]}])
    assert read_rows(path)[0].prompt == chat(("user", "hi"))


# -- JSONL and Parquet -----------------------------------------------------------------------------


def test_parquet_and_jsonl_give_equal_rows(tmp_path):
    rows = [
        {"messages": chat(("system", "s"), ("user", "1+2?")), "answer": "#### 3", "level": 1, "tags": ["a", "b"]},
        {"messages": chat(("user", "7*6?")), "answer": "#### 42", "level": 2, "tags": []},
    ]
    fmt = RowFormat(system_prompt="Use digits.")
    from_jsonl = read_rows(write_jsonl(tmp_path / "data.jsonl", rows), fmt)
    from_parquet = read_rows(write_parquet(tmp_path / "data.parquet", rows), fmt)
    assert from_parquet == from_jsonl
    assert from_jsonl[1] == Row(
        "data-2", chat(("system", "Use digits."), ("user", "7*6?")), "42", {"level": 2, "tags": []}
    )


texts = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30).filter(str.strip)
answers = st.integers(-(10**6), 10**6)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(texts, answers, texts), min_size=1, max_size=8))
def test_any_text_rows_read_the_same_from_both_formats(tmp_path, content):
    rows = [{"prompt": p, "gold": g, "note": n} for p, g, n in content]
    assert read_rows(write_parquet(tmp_path / "d.parquet", rows)) == read_rows(write_jsonl(tmp_path / "d.jsonl", rows))


def test_parquet_timestamps_become_text(tmp_path):
    import datetime

    rows = [{"prompt": "p", "gold": 1, "at": datetime.datetime(2026, 1, 2, 3, 4, 5)}]
    (row,) = read_rows(write_parquet(tmp_path / "t.parquet", rows))
    assert row.fields == {"at": "2026-01-02T03:04:05"}
    json.dumps(row.fields)  # JSON types only: rows go into checkpoints and result files


# -- bad input -------------------------------------------------------------------------------------

BAD_ROWS = [
    ({"text": "hi"}, "the prompt field 'prompt' is missing or null"),
    ({"prompt": None, "gold": "1"}, "the prompt field 'prompt' is missing or null"),
    ({"prompt": "p"}, "the answer field 'gold' is missing or null"),
    ({"prompt": "", "gold": "1"}, "field 'prompt' is empty"),
    ({"prompt": 7, "gold": "1"}, "field 'prompt' must be text or a list of {role, content} turns, got int"),
    ({"prompt": "p", "gold": True}, "field 'gold' must be text or a number, got bool"),
    ({"prompt": "p", "gold": None}, "the answer field 'gold' is missing or null"),
    ({"prompt": "p", "gold": " "}, "field 'gold' is empty"),
    ({"prompt": "p", "gold": "so #### forty"}, "field 'gold': the text after '####' is not a number"),
    ({"prompt": [], "gold": "1"}, "field 'prompt' is an empty conversation"),
    ({"prompt": ["hi"], "gold": "1"}, "field 'prompt', turn 0: expected an object with 'role' and 'content'"),
    ({"prompt": [{"role": "user"}], "gold": "1"}, "turn 0: 'content' must be a string, got NoneType"),
    ({"prompt": [{"content": "c"}], "gold": "1"}, "turn 0: 'role' must be a non-empty string"),
    ({"prompt": [{"role": "user", "content": "c", "name": "x"}], "gold": "1"}, "turn 0: unexpected keys ['name']"),
    ({"prompt": chat(("user", "q"), ("assistant", "a")), "gold": "1"}, "ends with a 'assistant' turn"),
]


GOOD = {"prompt": "fine", "gold": "1"}


def parquet_holds(row: dict) -> bool:
    """A Parquet column has one type: a row whose field differs in type from GOOD's cannot sit
    beside it in one file (those cases are JSONL's alone)."""
    try:
        pa.Table.from_pylist([GOOD, row])
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return False
    return True


BAD_FILES = [("jsonl", row, message) for row, message in BAD_ROWS] + [
    ("parquet", row, message) for row, message in BAD_ROWS if parquet_holds(row)
]


@pytest.mark.parametrize("suffix, row, message", BAD_FILES)
def test_a_bad_row_is_named_with_its_file_row_and_field(tmp_path, suffix, row, message):
    if suffix == "parquet":
        path = write_parquet(tmp_path / "bad.parquet", [GOOD, row])
        where = f"{path}:row 2: "
    else:
        path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, row])
        where = f"{path}:2: "
    with pytest.raises(RowError) as caught:
        read_rows(path)
    assert str(caught.value).startswith(where), caught.value
    assert message in str(caught.value)


def test_parquet_cases_cover_the_conversation_rules():
    assert sum(suffix == "parquet" for suffix, _, _ in BAD_FILES) >= 4


@pytest.mark.parametrize(
    "lines, message",
    [
        (["{not json"], ":1: not JSON"),
        (["[1, 2]"], ":1: expected a JSON object, got list"),
        ([{"prompt": "a", "gold": 1}, {"prompt": chat(("user", "b")), "gold": 2}], "all text or all conversations"),
    ],
)
def test_file_level_errors(tmp_path, lines, message):
    path = write_jsonl(tmp_path / "f.jsonl", lines)
    with pytest.raises(RowError, match=message):
        read_rows(path)


def test_the_text_row_is_named_when_a_file_mixes_text_and_conversations(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": chat(("user", "b")), "gold": 2}, {"prompt": "a", "gold": 1}])
    with pytest.raises(RowError, match=rf"^{path}:2: field 'prompt' is text"):
        read_rows(path)


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_a_file_without_rows_is_an_error(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(RowError, match=rf"^{path}: no rows$"):
        read_rows(path)


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok", "gold": "1"}\n{"prompt": "caf\xe9", "gold": "1"}\n')
    with pytest.raises(RowError, match=rf"^{path}:2: not UTF-8"):
        read_rows(path)


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    path = tmp_path / "fake.parquet"
    path.write_text('{"prompt": "p"}\n')
    with pytest.raises(RowError, match=rf"^{path}: not a readable Parquet file"):
        read_rows(path)


@pytest.mark.parametrize("name, message", [("rows.csv", "unknown file type '.csv'"), ("gone.jsonl", "no such file")])
def test_unknown_or_missing_files(tmp_path, name, message):
    with pytest.raises(RowError, match=message):
        read_rows(tmp_path / name)


@pytest.mark.parametrize(
    "fmt, row, message",
    [
        (RowFormat(template="{0}"), {"question": "q"}, "must name row fields"),
        (RowFormat(template="{question"), {"question": "q"}, "not a format string"),
        (RowFormat(template="{missing}"), {"question": "q"}, "names field 'missing', which the row lacks"),
        (RowFormat(template="{question}"), {"messages": chat(("user", "q"))}, "a template builds text prompts only"),
        (RowFormat(system_prompt="s"), {"prompt": "q"}, "set chat = true"),
        (RowFormat(prompt_field="problem"), {"prompt": "q"}, "the prompt field 'problem' is missing"),
    ],
)
def test_format_settings_that_do_not_fit_the_rows(tmp_path, fmt, row, message):
    path = write_jsonl(tmp_path / "s.jsonl", [row])
    with pytest.raises(RowError, match=message):
        read_rows(path, fmt)


def test_nothing_is_half_loaded(tmp_path):
    """A bad last row fails the whole file: no caller ever trains on the rows before it."""
    rows = [{"prompt": f"p{i}", "gold": i} for i in range(100)] + [{"prompt": "p", "gold": [1]}]
    with pytest.raises(RowError, match=":101: "):
        read_rows(write_jsonl(tmp_path / "long.jsonl", rows))
