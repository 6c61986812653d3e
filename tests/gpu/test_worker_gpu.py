"""A real `rollout-svc serve` worker on one GPU, with its defaults there (bfloat16, CUDA graphs),
through the real spool: generation, bf16 logprobs against float32 transformers within a derived
tolerance, an in-place reload, an eval job (`spoolctl eval`), and a rebuild for another
architecture that gives the old engine's device memory back.

The worker is shared by the module; a test that finds it gone starts it again.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time

import pytest
from gpu_support import (
    BIN,
    GIB,
    GPU_MEMORY_UTILIZATION,
    MAX_MODEL_LEN,
    ServedWorker,
    built_engine_pids,
    check_bf16_greedy,
    check_bf16_logprobs,
    free_bytes,
    gib,
    keep_running,
)

from protocol.messages import Request
from protocol.spool import Spool
from rollout_svc.engines.host import wait_gone

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

WORKER = "gpu-worker"


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    """The module's worker (started by the tests), and the free device memory before it."""
    base = tmp_path_factory.mktemp("gpu-worker")
    args = [
        "--engine", "vllm", "--allowed-root", str(models["root"]), "--weights", str(models["a"]),
        "--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION),
        "--idle-exit", "1800", "--metrics-dir", str(base / "metrics"),
    ]  # fmt: skip
    baseline = free_bytes()
    served = ServedWorker(Spool(base / "spool", create=True), WORKER, args, log_dir=base)
    try:
        yield served, baseline
    finally:
        served.stop()


@pytest.fixture
def worker(served):
    served_worker, baseline = served
    keep_running(served_worker)
    return served_worker, baseline


def log_of(worker: ServedWorker) -> str:
    return (worker.log_dir / f"{worker.worker_id}.log").read_text(errors="replace")


_ids = iter(range(10**6))


def ask(client, weights_dir, prompts=("12+7=", "Hello"), **fields):
    fields = dict(n_samples_per_prompt=1, max_tokens=12, temperature=0.0) | fields
    request = Request(request_id=f"g{next(_ids)}-{time.time_ns()}", weights_dir=str(weights_dir),
                      prompts=list(prompts), **fields)  # fmt: skip
    client.submit(request)
    return client.wait([request.request_id], timeout_s=600)[request.request_id]


def test_generation_through_the_spool(worker, models, client_for, reference):
    served, _ = worker
    client = client_for(served.spool.root)
    prompts = ["12+7=", "Hello", "The answer is"]
    result = ask(client, models["a"], prompts, n_samples_per_prompt=4, max_tokens=10, temperature=1.0, seed=7)
    assert result.ok, result.error
    tokenizer = reference.tokenizer(models["a"])
    assert result.prompt_token_ids == [tokenizer(p)["input_ids"] for p in prompts]
    for texts, ids, logprobs, reasons in zip(
        result.texts, result.token_ids, result.logprobs, result.finish_reasons, strict=True
    ):
        assert len(texts) == 4
        for text, sample_ids, sample_logprobs, reason in zip(texts, ids, logprobs, reasons, strict=True):
            assert 1 <= len(sample_ids) <= 10 and len(sample_logprobs) == len(sample_ids)
            assert tokenizer.decode(sample_ids, skip_special_tokens=True) == text
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in sample_logprobs)
            assert reason in ("stop", "length")
    assert result.engine.startswith("vllm") and result.weights_dir == str(models["a"])


def test_the_worker_runs_cuda_graphs_by_default(worker):
    served, _ = worker
    built = re.findall(r"engine process \d+ built for .* \((.*)\)", log_of(served))
    print(f"\nengine builds in the worker log: {built}")
    assert built, "no engine build in the worker log"
    captured = re.fullmatch(r"CUDA graphs (\w+), (\d+) captured", built[0])
    assert captured and int(captured.group(2)) > 0, built[0]


def test_bf16_sampling_logprobs_within_the_rounding_bound(worker, models, client_for, reference):
    """The worker's default dtype on GPU is bf16; transformers runs float32 on the CPU. The bound
    per token is 2 c U H / T (derived at gpu_support.BF16_U)."""
    served, _ = worker
    client = client_for(served.spool.root)
    temperature = 0.8
    result = ask(client, models["a"], ["12+7=", "Hello", "abc"], n_samples_per_prompt=4, max_tokens=16,
                 temperature=temperature, seed=3)  # fmt: skip
    assert result.ok, result.error
    check_bf16_logprobs(reference, models["a"], result, temperature)


def test_reload_in_place_serves_the_new_weights(worker, models, client_for, reference):
    served, _ = worker
    client = client_for(served.spool.root)
    builds = built_engine_pids(served.log_dir / f"{WORKER}.log")
    before = ask(client, models["a"], ["12+7="])
    after = ask(client, models["b"], ["12+7="])
    assert after.ok and after.weights_dir == str(models["b"]) and after.weights_content_id != before.weights_content_id
    check_bf16_greedy(reference, models["b"], after.prompt_token_ids[0], after.token_ids[0][0])
    assert after.token_ids != before.token_ids
    print(f"\nin-place reload {after.timings.reload_s:.3f} s for {after.timings.reload_bytes} bytes; "
          f"engine build {served.ready.engine_build_s:.1f} s")  # fmt: skip
    assert after.timings.reload_s > 0 and after.timings.reload_bytes > 0
    assert built_engine_pids(served.log_dir / f"{WORKER}.log") == builds, "the reload built a new engine"
    assert "reloaded" in log_of(served) and "in place" in log_of(served)


def test_an_eval_job_through_the_spool(worker, models, tmp_path):
    served, _ = worker
    rows = [{"question": f"{a}+{b}=", "answer": f"#### {a + b}"} for a, b in [(1, 2), (12, 7), (20, 20), (3, 9)]]
    prompts = tmp_path / "rows.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    run = subprocess.run(
        [str(BIN / "spoolctl"), "eval", "-s", str(served.spool.root), str(prompts), "--weights", str(models["a"]),
         "--out", str(out), "--max-tokens", "8", "--timeout", "600"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    print(f"\n{run.stdout}{run.stderr}")
    assert run.returncode == 0
    assert re.search(r"4 prompts in [\d.]+ s, accuracy [\d.]+", run.stdout)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["prompt"] for w in written] == [r["question"] for r in rows]  # the prompt as sent
    for row, given in zip(written, rows, strict=True):
        assert row["gold"] == given["answer"].removeprefix("#### ")
        assert len(row["completions"]) == 1 and isinstance(row["completions"][0], str)
        assert len(row["predicted"]) == 1 and len(row["correct"]) == 1


def test_another_architecture_rebuilds_and_gives_the_memory_back(worker, models, client_for, reference):
    served, baseline = worker
    client = client_for(served.spool.root)
    assert ask(client, models["a"]).ok
    one_engine = baseline - free_bytes()
    log_path = served.log_dir / f"{WORKER}.log"
    old = built_engine_pids(log_path)[-1]
    result = ask(client, models["wide"], ["12+7="], max_tokens=10)
    assert result.ok, result.error
    check_bf16_greedy(reference, models["wide"], result.prompt_token_ids[0], result.token_ids[0][0])
    new = built_engine_pids(log_path)[-1]
    assert new != old and wait_gone({old}, 0) == set(), "the old engine process still runs"
    held = baseline - free_bytes()
    print(f"\nrebuild {result.timings.reload_s:.1f} s; one engine held {gib(one_engine)}, "
          f"after the rebuild {gib(held)}")  # fmt: skip
    assert held < one_engine * 1.25 + GIB, "the old engine's memory was not given back"
