"""Eval jobs through the spool: prompts in, completions (and accuracy) out.

Input rows (JSONL), one of:
    {"prompt": "..."}                                    plain prompt
    {"question": "...", "answer": "... #### 42"}         GSM8K format: gold answer after ####

    from protocol.evaluation import read_rows, run_eval, write_rows
    rows = read_rows("gsm8k_test.jsonl")
    with SpoolClient("/srv/spool") as client:
        report = run_eval(client, rows, weights_dir="/ckpt/step_00000100", max_tokens=256)
    write_rows("out.jsonl", report.rows)
    print(report.accuracy)

A completion is correct as protocol.answers defines it, the definition the trainer's rewards use
(the answer after "####", else in the last \\boxed{}, else the last number; equal by value).
`accuracy` averages over every sample of every row that has an answer.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from .answers import extract_answer, gold_from_answer, verdict
from .client import SpoolClient
from .fsio import replace_atomic
from .jsonl import json_lines
from .messages import Request


class RowError(ValueError):
    """A prompt file row that cannot be used; the message names the file and line."""


@dataclass
class EvalRow:
    prompt: str
    gold: str | None = None  # the gold number, for rows with an answer
    source: dict | None = None  # the row as read, echoed into the output


@dataclass
class EvalReport:
    rows: list[dict]  # one output row per input row
    accuracy: float | None  # None when no row has an answer
    seconds: float


def read_rows(path: str | Path, template: str = "{question}") -> list[EvalRow]:
    """Read a JSONL prompt file. `template` builds the prompt of GSM8K rows from `question`."""
    rows = []
    for _, where, data in json_lines(path, RowError):
        if not isinstance(data, dict):
            raise RowError(f"{where}: expected an object with 'prompt', or 'question' and 'answer'")
        if isinstance(data.get("prompt"), str):
            rows.append(EvalRow(data["prompt"], None, data))
        elif isinstance(data.get("question"), str) and isinstance(data.get("answer"), str):
            try:
                gold = gold_from_answer(data["answer"])
            except ValueError as exc:
                raise RowError(f"{where}: {exc}") from None
            rows.append(EvalRow(template.format(question=data["question"]), gold, data))
        else:
            raise RowError(f"{where}: expected a string 'prompt', or string 'question' and 'answer'")
    if not rows:
        raise RowError(f"{path} holds no rows")
    return rows


def run_eval(
    client: SpoolClient,
    rows: list[EvalRow],
    *,
    weights_dir: str,
    max_tokens: int,
    n_samples: int = 1,
    temperature: float = 0.0,
    seed: int | None = 0,
    stop: list[str] | None = None,
    prompts_per_request: int = 64,
    timeout_s: float = 3600.0,
    name: str = "eval",
) -> EvalReport:
    """Submit every row through the spool, wait, and score the rows that have answers."""
    started = time.monotonic()
    # Unique per run, even for two evals started in the same second.
    stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"
    requests = [
        Request(
            request_id=f"{name}-{stamp}-{i // prompts_per_request:05d}",
            weights_dir=weights_dir,
            prompts=[row.prompt for row in rows[i : i + prompts_per_request]],
            n_samples_per_prompt=n_samples,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            stop=stop or [],
            logprobs=False,
            tag="eval",
            call_id=f"{name}-{stamp}",  # one call: its parts spread over the idle workers
        )
        for i in range(0, len(rows), prompts_per_request)
    ]
    client.submit_many(requests)
    results = client.wait([r.request_id for r in requests], timeout_s=timeout_s)
    failed = [r for r in results.values() if not r.ok]
    if failed:
        first = failed[0]
        raise RuntimeError(
            f"{len(failed)} eval requests failed; {first.request_id}: {first.error.code.value}: {first.error.message}"
        )
    completions = [texts for request in requests for texts in results[request.request_id].texts]
    out, scored, correct = [], 0, 0
    for row, texts in zip(rows, completions, strict=True):
        record = dict(row.source or {}, prompt=row.prompt, completions=texts)
        if row.gold is not None:
            predicted = [extract_answer(t) for t in texts]
            hits = [verdict(p, row.gold) is True for p in predicted]
            record.update(gold=row.gold, predicted=predicted, correct=hits)
            scored += len(hits)
            correct += sum(hits)
        out.append(record)
    accuracy = correct / scored if scored else None
    return EvalReport(out, accuracy, time.monotonic() - started)


def write_rows(path: str | Path, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode())
