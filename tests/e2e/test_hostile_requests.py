"""Valid requests with hostile values, and weights directories holding files no reader may open,
sent through real spools to real `rollout-svc serve` processes (the echo engine, and vLLM on the
tiny model): each request gets exactly one result, refusals carry a stable code, no worker exits.

A generated request (hypothesis) stays within the schema (protocol.messages.Request) and goes to
its extremes: huge, zero and negative numbers where allowed, empty and huge strings, odd Unicode,
token ids naming surrogates or past any vocabulary, stop strings, many prompts.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import msgspec
import pytest
from conftest import ServedWorker, keep_running, poll, start_worker, stop_worker, wait_for_status
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from protocol.messages import ErrorCode, Request, Result
from protocol.spool import Spool

RESULT_TIMEOUT_S = 180.0
_ids = itertools.count()


def request_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}-{time.time_ns()}"


def one_result(client, spool: Spool, request: Request, proc) -> Result:
    """Submit `request`, wait for its one result; the worker must still run and hold no claim of it."""
    client.submit(request)
    result = client.wait([request.request_id], timeout_s=RESULT_TIMEOUT_S, consume=False)[request.request_id]
    assert result.request_id == request.request_id
    assert proc.poll() is None, f"the worker exited with {proc.returncode} on {request!r:.2000}"
    claimed = poll(lambda: [e.name for e in spool.entries("claimed") if e.name.startswith(request.request_id + "@")],
                   until=lambda names: not names)  # fmt: skip
    assert not claimed, f"{claimed} still claimed after its result"
    return result


# -- an echo worker process ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile-echo")
    spool = Spool(base / "spool", create=True)
    proc = start_worker(spool.root, "hostile-echo", "--engine", "echo", "--idle-exit", "0", log_dir=base)
    wait_for_status(spool, "hostile-echo", lambda s: s.state == "idle", 60, proc)
    yield {"spool": spool, "proc": proc}
    stop_worker(proc)


def test_one_unencodable_answer_loses_nothing_of_its_batch(tmp_path, client_for):
    """A batch of five, the third asking to echo a lone surrogate: each gets one result, the hostile
    one `invalid_request`, and the worker serves on (it used to exit 1 and lose the batch)."""
    spool = Spool(tmp_path / "spool", create=True)
    fine = [
        Request(request_id=f"fine-{i}", weights_dir="/models/echo", prompts=[f"hello {i}"],
                n_samples_per_prompt=2, max_tokens=8, temperature=1.0)
        for i in range(4)
    ]  # fmt: skip
    hostile = Request(request_id="hostile", weights_dir="/models/echo", prompt_token_ids=[[55296, 65]],
                      n_samples_per_prompt=1, max_tokens=4, temperature=0.0)  # fmt: skip
    client = client_for(spool.root)
    client.submit_many([*fine[:2], hostile, *fine[2:]])  # all there before the worker's first scan: one batch
    proc = start_worker(spool.root, "batch-echo", "--engine", "echo", "--idle-exit", "0", log_dir=tmp_path)
    try:
        ids = [r.request_id for r in [*fine, hostile]]
        results = client.wait(ids, timeout_s=RESULT_TIMEOUT_S, consume=False)
        assert proc.poll() is None, f"the worker exited with {proc.returncode}"
        assert all(results[r.request_id].ok for r in fine)
        assert results["hostile"].error.code is ErrorCode.INVALID_REQUEST
        assert "surrogate" in results["hostile"].error.message
        assert poll(lambda: os.listdir(spool.claimed), until=lambda names: not names) == []
        after = Request(request_id="after", weights_dir="/models/echo", prompts=["still here"],
                        n_samples_per_prompt=1, max_tokens=20, temperature=0.0)  # fmt: skip
        assert one_result(client, spool, after, proc).texts == [["still here"]]
    finally:
        assert stop_worker(proc) == 0


def test_a_tiny_request_asking_a_million_samples_is_refused_naming_the_option(echo, client_for):
    spool, proc = echo["spool"], echo["proc"]
    client = client_for(spool.root)
    huge = Request(request_id=request_id("million"), weights_dir="/m", prompts=["hi"],
                   n_samples_per_prompt=1_000_000, max_tokens=1, temperature=0.0)  # fmt: skip
    assert len(msgspec.json.encode(huge)) < 400
    result = one_result(client, spool, huge, proc)
    assert result.error.code is ErrorCode.REQUEST_TOO_LARGE
    assert "--max-samples" in result.error.message and "1000000" in result.error.message
    assert os.path.getsize(spool.result_path(huge.request_id)) < 4096
    ok = Request(request_id=request_id("after"), weights_dir="/m", prompts=["hi"],
                 n_samples_per_prompt=3, max_tokens=2, temperature=0.0)  # fmt: skip
    assert one_result(client, spool, ok, proc).texts == [["hi"] * 3]


# -- generated requests ----------------------------------------------------------------------------

ODD_TEXTS = ["", "\x00", "\U0010ffff", "e\u0301", "\u202e\u2066", "\ufeff", "a" * 100_000, "\U0001f642" * 3000]


def mostly(ordinary, extremes: list):
    """`ordinary` seven times in eight, else one of `extremes`: most requests reach the engine.
    (st.one_of picks its branches evenly, and one branch repeated counts once.)"""
    return st.sampled_from([False] * 7 + [True]).flatmap(lambda odd: st.sampled_from(extremes) if odd else ordinary)


odd_text = mostly(st.text(min_size=1, max_size=30), ODD_TEXTS)
EXTREME_IDS = [0, 1, 55296, 57343, 0x10FFFF, 0x110000, 2**31, 2**63 - 1]
token_ids = st.lists(mostly(st.integers(0, 127), EXTREME_IDS), min_size=1, max_size=12)  # the tiny model's vocab
turn = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "x" * 64]), "content": odd_text})
prompt_fields = st.one_of(
    st.fixed_dictionaries({"prompts": mostly(st.lists(odd_text, min_size=1, max_size=4), [["x"] * 5000])}),
    st.fixed_dictionaries({"prompts": st.lists(odd_text, min_size=1, max_size=4)}),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(token_ids, min_size=1, max_size=4)}),
    st.fixed_dictionaries({"messages": st.lists(st.lists(turn, min_size=1, max_size=3), min_size=1, max_size=2)}),
)
OVER_LIMITS = [1025, 10**6, 2**63 - 1]  # above the default --max-samples (and so the token limit)


def requests(weights_dirs: list[str]):
    """Requests valid by the schema, at its extremes; small where they would make a vLLM call long."""
    return st.fixed_dictionaries(
        {
            "weights_dir": mostly(st.just(weights_dirs[0]), weights_dirs[1:]),
            "n_samples_per_prompt": mostly(st.integers(1, 3), OVER_LIMITS),
            "max_tokens": mostly(st.integers(1, 6), [511, 10**9, 2**63 - 1]),
            "temperature": mostly(st.floats(0, 2), [0.0, 5e-324, 1e-300, 1e300, 1.7e308]),
            "top_p": mostly(st.floats(0, 1, exclude_min=True), [5e-324, 1.0]),
            "seed": st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
            "stop": st.lists(odd_text, max_size=3),
            "logprobs": st.booleans(),
            "deadline": mostly(st.none(), [0.0, 4e9]),
            "tag": odd_text,
            "weights_content_id": mostly(st.none(), ["", "x", "\U0010ffff" * 100]),
        },
    ).flatmap(lambda fields: prompt_fields.map(lambda prompts: {**fields, **prompts}))


def as_request(fields: dict) -> Request:
    return msgspec.convert({"request_id": request_id("gen"), **fields}, Request)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(fields=requests(["/models/echo", "/", "/" + "d" * 4000, "/nonexistent/\u00fc"]))
def test_generated_requests_each_get_one_result_from_the_echo(echo, client_for, fields):
    spool, proc = echo["spool"], echo["proc"]
    result = one_result(client_for(spool.root), spool, as_request(fields), proc)
    event("ok" if result.ok else result.error.code.value)  # hypothesis's statistics: what the examples met


# -- a vLLM worker on the tiny model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def hostile_root(tmp_path_factory) -> Path:
    """A second allowed root of the module's worker, for directories planted inside the roots."""
    return tmp_path_factory.mktemp("hostile-root")


@pytest.fixture(scope="module")
def served(models, hostile_root, tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile-vllm")
    args = [
        "--engine", "vllm", "--allowed-root", str(models["root"]), "--allowed-root", str(hostile_root),
        "--weights", str(models["a"]), "--max-model-len", "512", "--idle-exit", "1800",
    ]  # fmt: skip
    served = ServedWorker(Spool(base / "spool", create=True), "hostile-vllm", args, log_dir=base)
    yield served
    served.stop()


@pytest.fixture
def vllm(served):
    keep_running(served)
    return {"spool": served.spool, "proc": served.proc}


def greedy(weights_dir, prompts=("12+7=",), **fields) -> Request:
    fields = dict(n_samples_per_prompt=1, max_tokens=4, temperature=0.0) | fields
    return Request(request_id=request_id("v"), weights_dir=str(weights_dir), prompts=list(prompts), **fields)


def test_a_fifo_manifest_outside_the_roots_is_refused_unread(vllm, models, tmp_path, client_for):
    """Its manifest used to be opened before the root check: the worker blocked on the FIFO forever."""
    outside = tmp_path / "outside"
    outside.mkdir()
    os.mkfifo(outside / "manifest.json")
    spool, proc = vllm["spool"], vllm["proc"]
    client = client_for(spool.root)
    refused = one_result(client, spool, greedy(outside), proc)
    assert refused.error.code is ErrorCode.WEIGHTS_NOT_ALLOWED and "allowed roots" in refused.error.message
    assert one_result(client, spool, greedy(models["a"]), proc).ok


def test_a_manifest_linked_to_dev_zero_inside_the_roots_is_refused_unread(vllm, models, hostile_root, client_for):
    """Its manifest used to be read whole, unbounded: /dev/zero until the memory ran out."""
    planted = hostile_root / "zero"
    planted.mkdir()
    os.symlink("/dev/zero", planted / "manifest.json")
    spool, proc = vllm["spool"], vllm["proc"]
    client = client_for(spool.root)
    refused = one_result(client, spool, greedy(planted), proc)
    assert refused.error.code in (ErrorCode.WEIGHTS_NOT_ALLOWED, ErrorCode.WEIGHTS_INVALID)
    assert "manifest.json" in refused.error.message and "/dev/zero" in refused.error.message
    assert one_result(client, spool, greedy(models["a"]), proc).ok


def test_a_seeded_batch_over_one_steps_token_budget_is_served_and_reproducible(vllm, models, client_for):
    """16 prompts x 8 samples x 47 tokens: 6,016 prompt tokens against the CPU engine's 4,096 per
    step. vLLM cut the prefill and then rewound the seeded generator, which a CPU generator cannot
    do: the engine died. Now it is served whole, and the same request gives the same samples."""
    spool, proc = vllm["spool"], vllm["proc"]
    client = client_for(spool.root)
    prompts = [f"{i:02d}: " + "the quick brown fox jumps over a lazy dog!"[: 47 - 4] for i in range(16)]
    fields = dict(n_samples_per_prompt=8, max_tokens=4, temperature=1.0, seed=1234)
    first = one_result(client, spool, greedy(models["a"], prompts, **fields), proc)
    assert first.ok, first.error
    assert sum(len(ids) for ids in first.prompt_token_ids) * 8 > 4096
    again = one_result(client, spool, greedy(models["a"], prompts, **fields), proc)
    assert again.token_ids == first.token_ids


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_generated_requests_each_get_one_result_from_vllm(vllm, models, client_for, data):
    weights = [str(models["a"]), "/", str(models["root"]), "/nonexistent/\u00fc"]
    fields = data.draw(requests(weights))
    spool, proc = vllm["spool"], vllm["proc"]
    result = one_result(client_for(spool.root), spool, as_request(fields), proc)
    event("ok" if result.ok else result.error.code.value)  # hypothesis's statistics: what the examples met
