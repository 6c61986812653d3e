"""Eval jobs through the spool: prompts in, completions (and accuracy) out.

Input rows are read by protocol.rows (JSONL or Parquet; text prompts or conversations, which
the worker renders with the model's chat template; an answer field where there is one), the
same reader the trainer uses, so an eval sees its prompts as training did.

    from protocol.evaluation import run_eval, write_rows
    from protocol.rows import RowFormat, read_rows
    rows = read_rows("gsm8k_test.jsonl", RowFormat(chat=True, system_prompt="Answer with a number."))
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

import msgspec

from .answers import extract_answer, verdict
from .client import SpoolClient
from .fsio import replace_atomic
from .messages import Request
from .rows import Row, RowError, RowFormat, prompt_fields, read_rows

__all__ = ["EvalReport", "Row", "RowError", "RowFormat", "read_rows", "run_eval", "write_rows"]


@dataclass
class EvalReport:
    rows: list[dict]  # one output row per input row
    accuracy: float | None  # None when no row has an answer
    seconds: float


def run_eval(
    client: SpoolClient,
    rows: list[Row],
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
    asked = {
        "weights_dir": weights_dir,
        "n_samples_per_prompt": n_samples,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "stop": stop or [],
        "logprobs": False,
        "tag": "eval",
        "call_id": f"{name}-{stamp}",  # one call: its parts spread over the idle workers
    }
    requests = [
        msgspec.convert(
            {
                "request_id": f"{name}-{stamp}-{i // prompts_per_request:05d}",
                **asked,
                **prompt_fields([row.prompt for row in rows[i : i + prompts_per_request]]),
            },
            Request,
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
        # The row's other fields as read, the prompt as sent, and the gold (below) as scored.
        record = dict(row.fields, prompt=row.prompt, completions=texts)
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
