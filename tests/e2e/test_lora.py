"""LoRA through one real vLLM worker (CPU build) started with --max-lora-rank: adapters published
by the trainer are served on the base the worker loaded, never reloading it.

- the logprobs the worker returns with an adapter are the trainer's own (PEFT) logprobs;
- an adapter of another base or of too high a rank gets an `adapter_refused` result naming the
  problem and what to do, and the worker serves on (a worker without LoRA refuses with the same
  code: tests/unit/test_adapters.py, without a second engine start);
- `spoolctl eval` (an eval job) names an adapter as it names any weights;
- `trainer-svc merge-adapter`'s export, served as ordinary weights, answers as the adapter does;
- `trainer-svc train` with [lora] takes GRPO steps through the worker: each publish is an adapter
  the worker loads in milliseconds, and the trainer's logprobs match the engine's at every step.

The module shares one worker (one engine start). vLLM 0.32's CPU build serves LoRA (checked here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ServedWorker, keep_running
from run_config import SMALL_STEPS, write_run_config

from protocol.messages import ErrorCode, Request
from protocol.spool import Spool
from protocol.weights_dir import ADAPTER_WEIGHTS, read_manifest

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
TRAINER_BIN = ROOT / ".venvs" / "trainer" / "bin"
SIDE = Path(__file__).with_name("lora_trainer_side.py")
WORKER = "e2e-lora"
MAX_RANK = 8


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    base = tmp_path_factory.mktemp("lora-worker")
    args = [
        "--engine", "vllm", "--allowed-root", str(models["root"]), "--weights", str(models["a"]),
        "--max-model-len", "128", "--idle-exit", "1800", "--max-lora-rank", str(MAX_RANK), "--max-cpu-loras", "2",
    ]  # fmt: skip
    served = ServedWorker(Spool(base / "spool", create=True), WORKER, args, log_dir=base)
    yield served
    served.stop()


@pytest.fixture
def worker(served):
    keep_running(served)
    return served


def trainer_side(*args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        [str(TRAINER_BIN / "python"), str(SIDE), *args], input=stdin, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def publish_adapter(base: Path, publish_dir: Path, step: int, rank: int = 4, seed: int = 0) -> tuple[str, str]:
    path, content_id = trainer_side("publish", str(base), str(publish_dir), str(step), str(rank), str(seed)).split()
    return path, content_id


_ids = iter(range(10**6))


def ask(client, weights_dir, prompts=("12+7=", "Hello"), **fields):
    fields = dict(n_samples_per_prompt=1, max_tokens=12, temperature=0.0) | fields
    request = Request(request_id=f"l{next(_ids)}-{time.time_ns()}", weights_dir=str(weights_dir),
                      prompts=list(prompts), **fields)  # fmt: skip
    client.submit(request)
    return client.wait([request.request_id], timeout_s=600)[request.request_id]


def test_the_workers_logprobs_with_an_adapter_are_the_trainers(worker, models, client_for):
    adapter, content_id = publish_adapter(models["a"], models["root"] / "lora-match", step=1)
    client = client_for(worker.spool.root)
    base = ask(client, models["a"])  # the base is live
    assert base.ok, base.error
    temperature = 0.8
    result = ask(client, adapter, ["12+7=", "Hello", "abc"], n_samples_per_prompt=4, max_tokens=16,
                 temperature=temperature, seed=3, weights_content_id=content_id)  # fmt: skip
    assert result.ok, result.error
    assert (result.weights_dir, result.weights_content_id) == (adapter, content_id)
    # The adapter was loaded, the base was not: the bytes read are the adapter's file alone.
    assert result.timings.reload_bytes == os.path.getsize(Path(adapter) / ADAPTER_WEIGHTS)
    pairs = [[p, s] for p, samples in zip(result.prompt_token_ids, result.token_ids, strict=True) for s in samples]
    expected = json.loads(trainer_side("logprobs", adapter, str(temperature), stdin=json.dumps(pairs)))
    served = [lp for samples in result.logprobs for lp in samples]
    diffs = [abs(a - b) for got, want in zip(served, expected, strict=True) for a, b in zip(got, want, strict=True)]
    print(f"\nlogprob |vLLM with adapter - trainer (PEFT)| over {len(diffs)} tokens: max {max(diffs):.2e}")
    assert len(diffs) > 12 and max(diffs) < 1e-3  # float32 on both sides; as for full weights

    again = ask(client, adapter, weights_content_id=content_id)  # cached: nothing loaded
    plain = ask(client, models["a"])
    assert again.ok and again.timings.reload_bytes == 0 and again.timings.reload_s == 0
    assert plain.ok and plain.timings.reload_bytes == 0  # back to the base: nothing to load either
    assert again.token_ids != plain.token_ids  # the adapter changes the answers
    status = json.loads((worker.spool.root / "workers" / f"{WORKER}.json").read_text())
    assert status["pid"] == worker.proc.pid
    assert status["engine_build_s"] == worker.ready.engine_build_s  # the engine of its start: never rebuilt


def test_adapters_past_the_engines_limit_are_evicted_and_loaded_again_when_named(worker, models, client_for):
    # --max-cpu-loras 2: a third adapter evicts the least recent; named again, it is loaded again
    # and answers as it did.
    adapters = [publish_adapter(models["a"], models["root"] / "lora-evict", step=s, seed=20 + s) for s in (1, 2, 3)]
    client = client_for(worker.spool.root)
    assert ask(client, models["a"]).ok
    first = [ask(client, path, weights_content_id=content_id) for path, content_id in adapters]
    assert all(r.ok and r.timings.reload_bytes > 0 for r in first), [r.error for r in first]
    again = ask(client, adapters[0][0], weights_content_id=adapters[0][1])
    assert again.ok and again.timings.reload_bytes == first[0].timings.reload_bytes  # read again, whole
    assert (again.token_ids, again.logprobs) == (first[0].token_ids, first[0].logprobs)
    newest = ask(client, adapters[2][0], weights_content_id=adapters[2][1])
    assert newest.ok and newest.timings.reload_bytes == 0  # still held


def test_an_adapter_the_worker_cannot_serve_is_refused_and_it_serves_on(worker, models, client_for):
    client = client_for(worker.spool.root)
    assert ask(client, models["a"]).ok
    other_base, _ = publish_adapter(models["b"], models["root"] / "lora-other-base", step=1)
    refused = ask(client, other_base)
    assert refused.error.code == ErrorCode.ADAPTER_REFUSED
    assert "LoRA adapter of the base model with content id" in refused.error.message
    assert str(models["a"]) in refused.error.message and "worker serving its base" in refused.error.message

    too_big, _ = publish_adapter(models["a"], models["root"] / "lora-rank16", step=1, rank=16)
    refused = ask(client, too_big)
    assert refused.error.code == ErrorCode.ADAPTER_REFUSED
    assert "rank 16, above this worker's --max-lora-rank 8" in refused.error.message

    fine, _ = publish_adapter(models["a"], models["root"] / "lora-fine", step=1, seed=5)
    assert ask(client, fine).ok  # the worker serves on
    assert len(list((worker.spool.root / "bad").glob("*.json"))) >= 2  # refused requests kept in bad/, as bad input


def test_an_eval_job_names_an_adapter(worker, models, tmp_path):
    adapter, _ = publish_adapter(models["a"], models["root"] / "lora-eval", step=3)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(4)))
    out = tmp_path / "out.jsonl"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "spoolctl"), "eval", "-s", str(worker.spool.root), str(rows),
         "--weights", adapter, "--out", str(out), "--max-tokens", "6", "--timeout", "600"],
        capture_output=True, text=True, timeout=700,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(out.read_text().splitlines()) == 4 and "accuracy" in done.stdout


def test_the_merged_export_served_as_full_weights_answers_as_the_adapter(worker, models, client_for):
    adapter, content_id = publish_adapter(models["a"], models["root"] / "lora-merge", step=2, seed=9)
    merged = models["root"] / "lora-merged"
    done = subprocess.run([str(TRAINER_BIN / "trainer-svc"), "merge-adapter", adapter, str(merged)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    client = client_for(worker.spool.root)
    assert ask(client, models["a"]).ok
    prompts = ["12+7=", "Hello", "abc"]
    with_adapter = ask(client, adapter, prompts, max_tokens=16, weights_content_id=content_id)
    as_model = ask(client, merged, prompts, max_tokens=16)
    assert with_adapter.ok and as_model.ok, (with_adapter.error, as_model.error)
    assert as_model.weights_content_id == f"merged-{content_id}" and as_model.timings.reload_bytes > 0
    assert as_model.token_ids == with_adapter.token_ids
    diffs = [abs(a - b) for x, y in zip(as_model.logprobs, with_adapter.logprobs, strict=True)
             for s, t in zip(x, y, strict=True) for a, b in zip(s, t, strict=True)]  # fmt: skip
    # W + BA merged in float32 against x W + (x A) B: the same sums in another order.
    assert max(diffs) < 1e-4
    # An adapter on the merged model (another base) is refused; the worker holds the merged weights.
    refused = ask(client, adapter, weights_content_id=content_id)
    assert refused.error.code == ErrorCode.ADAPTER_REFUSED and "lora-merged" in refused.error.message
    assert ask(client, models["a"]).ok


def test_grpo_with_lora_through_the_worker_publishes_adapters_it_serves_without_reloading_the_base(
    worker, models, tmp_path, client_for
):
    assert ask(client_for(worker.spool.root), models["a"]).ok  # the base live before the run starts
    log_start = len((worker.log_dir / f"{WORKER}.log").read_text())
    # A reward that varies within a group on an untrained model (the share of digits), so steps
    # have gradients; the KL term's reference is the base with the adapter off.
    (tmp_path / "digit_reward.py").write_text(
        "def digits(completions, **kwargs):\n"
        "    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]\n"
    )
    run_dir = tmp_path / "run"
    config = write_run_config(
        tmp_path / "lora.toml",
        SMALL_STEPS,
        {
            "run": {"dir": run_dir, "seed": 2},
            "model": {"path": models["a"]},
            "rollout": {"spawn": False, "spool": worker.spool.root},
            "train": {"steps": 4, "lr": 1e-3},
            "loss": {"kl_coef": 0.01},
            "reward": {"functions": ["digit_reward:digits"], "weights": [1.0]},
            "publish": {"dir": models["root"] / "lora-grpo"},
            "lora": {"rank": 8, "alpha": 16.0},
        },
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([str(TRAINER_BIN / "trainer-svc"), "train", str(config)], capture_output=True, text=True,
                          timeout=800, cwd=ROOT, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and any(row["grad_norm"] > 0 for row in rows)
    # The engine sampled each step from the adapter the trainer published: same logprobs.
    assert max(row["mismatch_max"] for row in rows) < 1e-3, [row["mismatch_max"] for row in rows]
    print(f"\nmismatch_max per step: {[row['mismatch_max'] for row in rows]}")
    for step in (2, 3, 4):  # publish.keep_last = 3
        manifest = read_manifest(models["root"] / "lora-grpo" / f"step_{step:08d}")
        assert manifest.adapter is not None and manifest.adapter.rank == 8
    # Each publish sampled from was loaded as an adapter, once; the base never again, in place or anew.
    during = (worker.log_dir / f"{WORKER}.log").read_text()[log_start:]
    assert [f"run-step_{step:08d}-" in during for step in (1, 2, 3)] == [True] * 3
    assert "reloaded " not in during and "engine process " not in during
    banner = json.loads((run_dir / "stage_result.json").read_text())["banner"]
    assert banner["weight_sync"].startswith("LoRA adapter directories")
