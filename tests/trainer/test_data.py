"""Training data: the arithmetic task, JSONL prompt files and their errors, split, PromptStream."""

from __future__ import annotations

import itertools
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_config
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import exit_codes
from trainer_svc.config import DataConfig, dump
from trainer_svc.data import (
    DataError,
    Problem,
    PromptStream,
    arithmetic_problems,
    check_chat_template,
    load_problems,
    read_prompt_file,
    split,
)


def write_lines(path, lines) -> str:
    """Write rows (dicts as JSON, strings as they are) one per line."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def problems(n: int) -> list[Problem]:
    return [Problem(f"p{i}", f"{i}+0=", str(i)) for i in range(n)]


# -- arithmetic_problems -------------------------------------------------------------------------


def test_arithmetic_defaults_are_every_sum_of_0_to_20():
    got = arithmetic_problems()
    assert len(got) == 21 * 21
    assert got[0] == Problem("add-0-0", "0+0=", "0")
    assert got[-1] == Problem("add-20-20", "20+20=", "40")
    assert Problem("add-3-17", "3+17=", "20") in got


def test_arithmetic_order_is_op_then_a_then_b():
    got = arithmetic_problems(1, 2, "*+")
    assert [p.id for p in got] == [
        "mul-1-1", "mul-1-2", "mul-2-1", "mul-2-2",
        "add-1-1", "add-1-2", "add-2-1", "add-2-2",
    ]  # fmt: skip


def test_arithmetic_golds_are_exact_results_in_the_answer_format():
    got = arithmetic_problems(0, 12, "+-*")
    assert len(got) == 3 * 13 * 13
    assert len({p.id for p in got}) == len(got)
    for p in got:
        name, a, b = p.id.split("-")
        op, expected = {"add": ("+", int(a) + int(b)), "sub": ("-", int(a) - int(b)), "mul": ("*", int(a) * int(b))}[
            name
        ]
        assert p.prompt == f"{a}{op}{b}="
        assert p.gold == str(expected)
    assert Problem("sub-3-12", "3-12=", "-9") in got
    assert Problem("mul-12-11", "12*11=", "132") in got


def test_arithmetic_prompts_use_only_characters_of_the_task():
    assert set("".join(p.prompt + p.gold for p in arithmetic_problems(0, 20, "+-*"))) <= set("0123456789+-*=")


def test_arithmetic_is_deterministic_and_a_single_value_range_works():
    assert arithmetic_problems(0, 5, "+-") == arithmetic_problems(0, 5, "+-")
    assert arithmetic_problems(7, 7, "-") == [Problem("sub-7-7", "7-7=", "0")]


@pytest.mark.parametrize(
    "low, high, ops, message",
    [(5, 4, "+", "low <= high"), (-1, 3, "+", "0 <= low"), (0, 3, "/", "ops"), (0, 3, "++", "ops"), (0, 3, "", "ops")],
)
def test_arithmetic_rejects_bad_arguments(low, high, ops, message):
    with pytest.raises(ValueError, match=message):
        arithmetic_problems(low, high, ops)


# -- prompt files (the rules of each field and bad row: tests/unit/test_rows.py) -----------------


def test_a_prompt_file_gives_problems_with_their_fields(tmp_path):
    path = write_lines(
        tmp_path / "gsm8k.jsonl",
        [
            {"question": "How many?", "answer": "3 * 4 = 12\n#### 1,234", "level": 2},
            "",
            {"question": "And?", "answer": 7, "level": 1},
        ],
    )
    assert read_prompt_file(path) == [
        Problem("gsm8k-1", "How many?", "1234", {"level": 2}),
        Problem("gsm8k-3", "And?", "7", {"level": 1}),
    ]


def test_the_data_section_chooses_fields_template_and_chat(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [{"problem": f"{i}+1", "target": i + 1, "src": "x"} for i in range(4)])
    data = DataConfig(
        task="file", path=path, prompt_field="problem", answer_field="target", template="Compute {problem}.",
        chat=True, system_prompt="Answer with a number.", held_out=1,
    )  # fmt: skip
    train, held_out = load_problems(data, seed=0)
    assert len(train) == 3 and len(held_out) == 1
    first = sorted(train + held_out, key=lambda p: p.id)[0]
    assert first == Problem(
        "t-1",
        [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "Compute 0+1."}],
        "1",
        {"src": "x"},
    )


def test_a_bad_row_is_a_data_error_naming_the_row(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", [{"prompt": "fine", "gold": "1"}, {"prompt": "p", "gold": [1]}])
    with pytest.raises(DataError, match=rf"^{path}:2: field 'gold' must be text or a number"):
        load_problems(DataConfig(task="file", path=path, held_out=0), seed=0)


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


def test_conversations_need_a_chat_template(tmp_path, tiny_model):
    """The tiny model's tokenizer has none: refused at launch, naming the row and the way out."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert not tokenizer.chat_template
    rows = [Problem("a-1", "plain", "1"), Problem("a-2", [{"role": "user", "content": "hi"}], "2")]
    with pytest.raises(
        DataError, match=r"^row a-2 is a conversation, but the model .* has no chat template.*`prompt` rows"
    ):
        check_chat_template(rows, tokenizer, str(tiny_model))
    check_chat_template(rows[:1], tokenizer, str(tiny_model))  # text rows need none
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    check_chat_template(rows, tokenizer, str(tiny_model))


@pytest.mark.timeout(120)
def test_a_launch_with_conversations_for_a_model_without_a_chat_template_exits_2(tmp_path, tiny_model):
    """From the user's side: `trainer-svc train`, exit 2 and the message before any step or spool."""
    rows = [{"messages": [{"role": "user", "content": f"{a}+{a}="}], "gold": 2 * a} for a in range(8)]
    data = {"task": "file", "path": write_lines(tmp_path / "c.jsonl", rows), "held_out": 2}
    # A spawned worker, as `make demo` runs; an echo one, as nothing is generated.
    venv = Path(__file__).resolve().parents[2] / ".venvs" / "rollout"
    rollout = {"spawn": True, "rollout_venv": str(venv), "worker_args": ["--engine", "echo"]}
    cfg = make_config(tmp_path / "run", tiny_model, data=data, rollout=rollout)
    config = tmp_path / "run.toml"
    config.write_bytes(dump(cfg))
    trainer = Path(sys.executable).parent / "trainer-svc"
    result = subprocess.run([str(trainer), "train", str(config)], capture_output=True, text=True, timeout=100)
    assert result.returncode == exit_codes.USAGE, result.stderr[-3000:]
    assert re.search(r"row \S+ is a conversation, but the model .* has no chat template", result.stderr)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- split ---------------------------------------------------------------------------------------


def test_split_partitions_and_keeps_order():
    items = problems(50)
    train, held = split(items, held_out=10, seed=3)
    assert len(train) == 40 and len(held) == 10
    assert sorted(train + held, key=items.index) == items
    assert train == sorted(train, key=items.index) and held == sorted(held, key=items.index)


def test_split_is_deterministic_per_seed():
    items = problems(50)
    assert split(items, 10, seed=3) == split(list(items), 10, seed=3)
    assert split(items, 10, seed=3)[1] != split(items, 10, seed=4)[1]


def test_split_edges():
    items = problems(5)
    assert split(items, 0, seed=0) == (items, [])
    train, held = split(items, 4, seed=0)
    assert len(train) == 1 and len(held) == 4


@pytest.mark.parametrize("held_out", [-1, 5, 6])
def test_split_rejects_sizes_that_leave_no_training_set(held_out):
    with pytest.raises(ValueError, match="held_out"):
        split(problems(5), held_out, seed=0)


# -- PromptStream --------------------------------------------------------------------------------


def test_each_epoch_is_the_documented_seeded_shuffle():
    items = problems(7)
    stream = PromptStream(items, seed=11)
    for epoch in range(3):
        order = list(range(7))
        random.Random(11 + epoch).shuffle(order)
        assert stream.take(7) == [items[i] for i in order]
    assert stream.epoch == 2  # the next epoch starts with the next take
    stream.take(1)
    assert stream.epoch == 3


def test_epochs_are_permutations_in_different_orders():
    items = problems(30)
    stream = PromptStream(items, seed=0)
    first, second = stream.take(30), stream.take(30)
    assert sorted(first, key=items.index) == items == sorted(second, key=items.index)
    assert first != second and first != items


def test_take_crosses_epochs_and_matches_iteration():
    items = problems(4)
    assert PromptStream(items, seed=5).take(10) == list(itertools.islice(PromptStream(items, seed=5), 10))


def test_take_zero_and_negative():
    stream = PromptStream(problems(3), seed=0)
    assert stream.take(0) == []
    assert stream.state_dict()["cursor"] == 0
    with pytest.raises(ValueError, match="n must be"):
        stream.take(-1)


def test_an_empty_stream_is_refused():
    with pytest.raises(ValueError, match="at least one problem"):
        PromptStream([], seed=0)


def test_state_dict_is_plain_json():
    stream = PromptStream(problems(3), seed=9)
    stream.take(4)
    assert json.loads(json.dumps(stream.state_dict())) == {"epoch": 1, "cursor": 1, "seed": 9, "size": 3}


@settings(max_examples=150, deadline=None)
@given(
    size=st.integers(1, 9),
    seed=st.integers(0, 2**31),
    before=st.lists(st.integers(0, 12), max_size=5),
    after=st.lists(st.integers(0, 12), max_size=5),
)
def test_a_restored_stream_continues_exactly_where_the_original_would(size, seed, before, after):
    items = problems(size)
    uninterrupted = PromptStream(items, seed=seed)
    expected = [uninterrupted.take(n) for n in before + after]

    original = PromptStream(items, seed=seed)
    got = [original.take(n) for n in before]
    state = json.loads(json.dumps(original.state_dict()))
    restored = PromptStream(items, seed=seed + 1)  # the state's seed must win
    restored.load_state_dict(state)
    got += [restored.take(n) for n in after]
    assert got == expected


def test_loading_a_state_for_another_problem_list_is_refused():
    state = PromptStream(problems(3), seed=0).state_dict()
    with pytest.raises(ValueError, match="state is for 3 problems"):
        PromptStream(problems(4), seed=0).load_state_dict(state)


@pytest.mark.parametrize("change", [{"cursor": 4}, {"cursor": -1}, {"epoch": -1}])
def test_loading_an_out_of_range_state_is_refused(change):
    state = dict(PromptStream(problems(3), seed=0).state_dict(), **change)
    with pytest.raises(ValueError, match="out of range"):
        PromptStream(problems(3), seed=0).load_state_dict(state)


def test_load_problems_builds_gsm8k_prompts_with_the_configured_template(tmp_path):
    from trainer_svc.config import DataConfig
    from trainer_svc.data import load_problems

    rows = [{"question": f"What is {i} + 1?", "answer": f"... #### {i + 1}"} for i in range(6)]
    path = write_lines(tmp_path / "rows.jsonl", [json.dumps(r) for r in rows])
    train, held = load_problems(DataConfig(task="file", path=path, template="Q: {question}\nA:", held_out=2), seed=0)
    assert len(train) == 4 and len(held) == 2
    assert all(p.prompt.startswith("Q: What is ") and p.prompt.endswith("\nA:") for p in train + held)


def test_load_problems_names_the_key_when_nothing_is_left_to_train_on():
    from trainer_svc.config import DataConfig
    from trainer_svc.data import DataError, load_problems

    with pytest.raises(DataError, match=r"data.held_out = 9 leaves no training problem of the 9"):
        load_problems(DataConfig(arithmetic_low=0, arithmetic_high=2, held_out=9), seed=0)
