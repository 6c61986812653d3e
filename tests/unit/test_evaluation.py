"""Eval jobs: prompt files, gold answers and number extraction, run_eval and `spoolctl eval`
against a real echo worker (each completion is its prompt, cut to max_tokens characters)."""

from __future__ import annotations

import json
import os
import time
import types

import pytest
from typer.testing import CliRunner

import protocol.evaluation as evaluation
from protocol.answers import extract_number, gold_from_answer, normalise_number
from protocol.cli import app
from protocol.client import SpoolClient
from protocol.evaluation import RowFormat, read_rows, run_eval, write_rows
from protocol.messages import ErrorCode
from rollout_svc.engines import RequestFailed
from rollout_svc.engines.echo import EchoEngine

pytestmark = pytest.mark.timeout(60)

# The echo engine answers with the question itself: the last number in it is the prediction.
GSM8K = [
    {"question": "Six times seven is 42", "answer": "6*7 = 42\n#### 42", "id": 1},
    {"question": "Ten halved is 5", "answer": "10/2 = 5\n#### 5", "id": 2},
    {"question": "Two plus two is 5", "answer": "2+2 = 4\n#### 4", "id": 3},
]


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def client_for(spool) -> SpoolClient:
    return SpoolClient(spool.root, create=False, rescan_s=0.1)


# Reading prompt files (JSONL and Parquet, every field rule and bad row): tests/unit/test_rows.py.


# -- numbers -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, gold",
    [
        ("#### 42", "42"),
        ("steps\n#### 42\n", "42"),
        ("#### 1,234,567", "1234567"),
        ("#### -3", "-3"),
        ("#### 2.5", "2.5"),
        ("#### 42.0", "42"),
        ("#### 42.00", "42"),
        ("#### 7.", "7"),
        ("#### 1 #### 2", "2"),  # the last marker
    ],
)
def test_gold_from_answer(answer, gold):
    assert gold_from_answer(answer) == gold


def test_gold_from_answer_without_the_marker():
    with pytest.raises(ValueError, match="no '#### <number>' line"):
        gold_from_answer("The answer is 42")


@pytest.mark.parametrize(
    "completion, number",
    [
        ("The answer is 42", "42"),
        ("The answer is 42.", "42"),
        ("First 3, then 4, finally 1,234", "1234"),
        ("It costs -12 dollars", "-12"),
        ("pi is about 3.14", "3.14"),
        ("42.0", "42"),
        ("-5.000", "-5"),
        ("1,000.0 apples", "1000"),
        ("I have 5, then 6,", "6"),
        ("007", "007"),
        ("no number here", None),
        ("", None),
        ("- . ,", None),
    ],
)
def test_extract_number(completion, number):
    assert extract_number(completion) == number


def test_42_point_0_equals_42_both_ways():
    assert extract_number("so 42.0") == gold_from_answer("#### 42") == "42"
    assert extract_number("so 42") == gold_from_answer("#### 42.0") == "42"
    assert extract_number("so 42.5") != gold_from_answer("#### 42")


@pytest.mark.parametrize("text, normal", [(" 1,000 ", "1000"), ("3.50", "3.50"), ("-0.0", "-0"), ("12", "12")])
def test_normalise_number(text, normal):
    assert normalise_number(text) == normal


# -- run_eval against an echo worker -------------------------------------------------------------


def test_run_eval_scores_every_row_exactly(spool, run_worker, tmp_path):
    rows = read_rows(write_jsonl(tmp_path / "g.jsonl", GSM8K))
    run_worker(spool)
    with client_for(spool) as client:
        report = run_eval(client, rows, weights_dir="/models/echo", max_tokens=64, prompts_per_request=64)
    assert report.accuracy == pytest.approx(2 / 3)
    assert report.seconds > 0
    assert [r["completions"] for r in report.rows] == [[g["question"]] for g in GSM8K]
    assert [r["correct"] for r in report.rows] == [[True], [True], [False]]
    assert [r["predicted"] for r in report.rows] == [["42"], ["5"], ["5"]]
    assert [r["gold"] for r in report.rows] == ["42", "5", "4"]
    assert [r["id"] for r in report.rows] == [1, 2, 3]  # the row's other fields are kept
    assert [r["prompt"] for r in report.rows] == [g["question"] for g in GSM8K]  # the prompt as sent


def test_run_eval_sends_conversations_for_the_worker_to_render(spool, run_worker, tmp_path, wait_for):
    """Chat rows go out as `messages`, with the system prompt: the producer needs no tokenizer.
    (The echo engine answers a conversation with its last turn.)"""
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [{"messages": [{"role": "user", "content": f"{a} plus {a} is {2 * a}"}], "answer": 2 * a} for a in (3, 4)],
    )
    rows = read_rows(path, RowFormat(system_prompt="Answer with a number."))
    run_worker(spool)
    with client_for(spool) as client:
        report = run_eval(client, rows, weights_dir="/models/echo", max_tokens=64, name="chat")
    assert report.accuracy == 1.0
    (served,) = served_requests(spool, wait_for, 1)
    request = json.loads((spool.done / served).read_text())
    assert request["prompts"] == []  # no text: the worker renders the conversations
    assert request["messages"][1] == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "4 plus 4 is 8"},
    ]
    assert report.rows[1]["prompt"] == request["messages"][1]


def served_requests(spool, wait_for, count: int) -> list[str]:
    """Names of the served requests in done/; the worker archives each just after its result."""

    def listed():
        names = sorted(e.name for e in spool.entries("done") if e.name.endswith(".request.json"))
        return names if len(names) >= count else None

    return wait_for(listed, what=f"{count} served requests in done/")


def test_run_eval_splits_prompts_across_requests_and_keeps_the_order(spool, run_worker, tmp_path, wait_for):
    questions = [{"question": f"Item {i} costs {i}", "answer": f"#### {i if i % 3 else i + 1}"} for i in range(7)]
    rows = read_rows(write_jsonl(tmp_path / "g.jsonl", questions))
    run_worker(spool)
    with client_for(spool) as client:
        report = run_eval(
            client, rows, weights_dir="/models/echo", max_tokens=64, n_samples=2, prompts_per_request=3, name="split"
        )
    served = served_requests(spool, wait_for, 3)
    assert len(served) == 3 and all(n.startswith("split-") for n in served)
    sizes = [len(json.loads((spool.done / n).read_text())["prompts"]) for n in served]
    assert sizes == [3, 3, 1]
    call_ids = {json.loads((spool.done / n).read_text()).get("call_id") for n in served}
    assert len(call_ids) == 1 and call_ids.pop().startswith("split-")  # one call: parts spread over idle workers
    assert [r["completions"] for r in report.rows] == [[q["question"]] * 2 for q in questions]
    assert [r["correct"] for r in report.rows] == [[i % 3 != 0] * 2 for i in range(7)]
    assert report.accuracy == pytest.approx(8 / 14)  # rows 0, 3, 6 wrong, two samples each


def test_run_eval_passes_max_tokens_to_the_engine(spool, run_worker, tmp_path):
    rows = read_rows(write_jsonl(tmp_path / "g.jsonl", [{"question": "The answer is 42", "answer": "#### 42"}]))
    run_worker(spool)
    with client_for(spool) as client:
        report = run_eval(client, rows, weights_dir="/models/echo", max_tokens=15)
    assert report.rows[0]["completions"] == ["The answer is 4"]
    assert report.rows[0]["predicted"] == ["4"] and report.accuracy == 0.0


def test_run_eval_without_answers_has_no_accuracy(spool, run_worker, tmp_path):
    rows = read_rows(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}]))
    run_worker(spool)
    with client_for(spool) as client:
        report = run_eval(client, rows, weights_dir="/models/echo", max_tokens=8)
    assert report.accuracy is None
    assert [r["completions"] for r in report.rows] == [["a"], ["b"]]
    assert all("correct" not in r for r in report.rows)


class RefusingEngine(EchoEngine):
    def generate(self, requests):
        raise RequestFailed(ErrorCode.WEIGHTS_NOT_FOUND, "weights_dir /models/none does not exist")


def test_run_eval_reports_failed_requests(spool, run_worker, tmp_path):
    rows = read_rows(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}]))
    run_worker(spool, RefusingEngine())
    with client_for(spool) as client, pytest.raises(RuntimeError) as info:
        run_eval(client, rows, weights_dir="/models/none", max_tokens=8, prompts_per_request=2)
    assert str(info.value).startswith("2 eval requests failed; eval-")
    assert "weights_not_found: weights_dir /models/none does not exist" in str(info.value)


def test_two_evals_started_in_the_same_second_both_run(spool, run_worker, tmp_path, monkeypatch):
    # A clock that stays within one second makes the collision deterministic.
    monkeypatch.setattr(
        evaluation, "time", types.SimpleNamespace(strftime=lambda fmt: "20250101T000000", monotonic=time.monotonic)
    )
    rows = read_rows(write_jsonl(tmp_path / "g.jsonl", GSM8K))
    run_worker(spool)
    with client_for(spool) as client:
        first = run_eval(client, rows, weights_dir="/models/step-100", max_tokens=64)
        second = run_eval(client, rows, weights_dir="/models/step-200", max_tokens=64)
    assert first.accuracy == second.accuracy == pytest.approx(2 / 3)


# -- write_rows ----------------------------------------------------------------------------------


def test_write_rows_writes_one_json_object_per_line(tmp_path):
    path = tmp_path / "deep" / "er" / "out.jsonl"
    rows = [{"prompt": "café", "completions": ["x\ny"]}, {"n": 1}]
    write_rows(path, rows)
    text = path.read_text(encoding="utf-8")
    assert "café" in text  # UTF-8, not \\u escapes
    assert [json.loads(line) for line in text.splitlines()] == rows
    assert text.endswith("\n") and text.count("\n") == 2
    assert os.listdir(path.parent) == ["out.jsonl"]


def test_write_rows_replaces_the_file_by_rename(tmp_path):
    path = tmp_path / "out.jsonl"
    write_rows(path, [{"a": 1}])
    inode = path.stat().st_ino
    write_rows(path, [{"a": 2}])
    assert path.stat().st_ino != inode
    assert path.read_text() == '{"a": 2}\n'


def test_write_rows_that_fails_leaves_the_old_file_intact(tmp_path):
    path = tmp_path / "out.jsonl"
    write_rows(path, [{"a": 1}])
    with pytest.raises(TypeError):
        write_rows(path, [{"a": 2}, {"b": object()}])
    assert path.read_text() == '{"a": 1}\n'


# -- spoolctl eval -------------------------------------------------------------------------------


runner = CliRunner()


def test_spoolctl_eval_writes_completions_and_prints_the_accuracy(spool, run_worker, tmp_path, wait_for):
    prompts = write_jsonl(tmp_path / "g.jsonl", GSM8K)
    out = tmp_path / "results" / "out.jsonl"
    run_worker(spool)
    result = runner.invoke(
        app,
        [
            "eval",
            "--spool",
            str(spool.root),
            prompts,
            "--weights",
            "/models/echo",
            "--out",
            str(out),
            "--max-tokens",
            "64",
            "--prompts-per-request",
            "2",
            "--template",
            "Q: {question}",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "3 prompts in " in result.output and "accuracy 0.667" in result.output
    assert f"completions in {out}" in result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [1, 2, 3]
    assert [r["completions"] for r in rows] == [[f"Q: {g['question']}"] for g in GSM8K]
    assert [r["correct"] for r in rows] == [[True], [True], [False]]
    assert len(served_requests(spool, wait_for, 2)) == 2


def test_spoolctl_eval_takes_parquet_chat_rows_and_a_system_prompt(spool, run_worker, tmp_path, wait_for):
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = tmp_path / "g.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K), prompts)
    out = tmp_path / "out.jsonl"
    run_worker(spool)
    result = runner.invoke(
        app,
        ["eval", "-s", str(spool.root), str(prompts), "--weights", "/models/echo", "--out", str(out)]
        + ["--max-tokens", "64", "--chat", "--system-prompt", "Think, then answer."],
    )
    assert result.exit_code == 0, result.output
    assert "accuracy 0.667" in result.output
    (served,) = served_requests(spool, wait_for, 1)
    conversations = json.loads((spool.done / served).read_text())["messages"]
    assert conversations[0] == [
        {"role": "system", "content": "Think, then answer."},
        {"role": "user", "content": GSM8K[0]["question"]},
    ]
    assert [json.loads(line)["correct"] for line in out.read_text().splitlines()] == [[True], [True], [False]]


def test_spoolctl_eval_refuses_a_bad_prompt_file_naming_the_line(spool, tmp_path):
    prompts = write_jsonl(
        tmp_path / "bad.jsonl", [{"question": "q", "answer": "#### 1"}, "", '{"question": "q", "answer": "#### no"}']
    )
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["eval", "--spool", str(spool.root), prompts, "--weights", "/m", "--out", str(out)])
    assert result.exit_code == 2
    assert f"error: {prompts}:3: field 'answer': the text after '####' is not a number" in result.output
    assert not out.exists()
    assert os.listdir(spool.requests) == []


def test_spoolctl_eval_refuses_a_missing_prompt_file(spool, tmp_path):
    result = runner.invoke(
        app,
        [
            "eval",
            "--spool",
            str(spool.root),
            str(tmp_path / "nope.jsonl"),
            "--weights",
            "/m",
            "--out",
            str(tmp_path / "o.jsonl"),
        ],
    )
    assert result.exit_code == 2
    assert "nope.jsonl" in result.output and "error:" in result.output


def test_spoolctl_eval_refuses_a_prompt_file_that_is_not_utf8(spool, tmp_path):
    prompts = tmp_path / "latin1.jsonl"
    prompts.write_bytes(b'{"prompt": "caf\xe9"}\n')
    result = runner.invoke(
        app, ["eval", "--spool", str(spool.root), str(prompts), "--weights", "/m", "--out", str(tmp_path / "o.jsonl")]
    )
    assert result.exit_code == 2
    assert f"error: {prompts}:1: " in result.output
