"""One real vLLM worker (CPU build) on tiny models, through the real spool.

Generation, logprobs against transformers, in-place reload, rebuild on an architecture change,
weights published into a slot of the trainer's ring, bad weights, bad prompts, the metrics
textfile, and SIGTERM while generating. The worker is
shared by the module; a test that finds it stopped (the SIGTERM test stops it) starts it again,
so the tests run in any order and alone.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ServedWorker, keep_running, poll, stop_worker, wait_for_status
from delta_chain import Chain, delta_bytes, manifest_of, moved

from protocol.messages import ChatTurn, ErrorCode, Request
from protocol.spool import Spool

pytestmark = pytest.mark.timeout(900)

WORKER = "e2e-vllm"
TRAINER_PYTHON = Path(__file__).resolve().parents[2] / ".venvs" / "trainer" / "bin" / "python"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm-worker")
    args = [
        "--engine", "vllm", "--allowed-root", str(models["root"]), "--weights", str(models["a"]),
        "--max-model-len", str(MAX_MODEL_LEN), "--idle-exit", "1800", "--metrics-dir", str(base / "metrics"),
    ]  # fmt: skip
    served = ServedWorker(Spool(base / "spool", create=True), WORKER, args, log_dir=base)
    yield served
    served.stop()


@pytest.fixture
def worker(served):
    """The module's worker, running and ready: started again if an earlier test stopped it."""
    keep_running(served)
    return {"spool": served.spool, "proc": served.proc, "base": served.log_dir, "build_s": served.ready.engine_build_s}


_ids = iter(range(10**6))


def ask(client, weights_dir, prompts=("12+7=", "Hello"), **fields):
    fields = dict(n_samples_per_prompt=1, max_tokens=12, temperature=0.0) | fields
    request_id = f"t{next(_ids)}-{time.time_ns()}"
    request = Request(request_id=request_id, weights_dir=str(weights_dir), prompts=list(prompts), **fields)
    client.submit(request)
    return client.wait([request.request_id], timeout_s=600)[request.request_id]


def test_generation_shapes_ids_texts_and_logprobs(worker, models, client_for, reference):
    client = client_for(worker["spool"].root)
    prompts = ["12+7=", "Hello", "The answer is"]
    result = ask(client, models["a"], prompts, n_samples_per_prompt=4, max_tokens=10, temperature=1.0, seed=7)
    assert result.ok, result.error
    tokenizer = reference.tokenizer(models["a"])
    assert [len(t) for t in result.texts] == [4, 4, 4]
    assert result.prompt_token_ids == [tokenizer(p)["input_ids"] for p in prompts]
    rows = zip(result.texts, result.token_ids, result.logprobs, result.finish_reasons, strict=True)
    for texts, ids, logprobs, reasons in rows:
        for text, sample_ids, sample_logprobs, reason in zip(texts, ids, logprobs, reasons, strict=False):
            assert 1 <= len(sample_ids) <= 10 and len(sample_logprobs) == len(sample_ids)
            assert tokenizer.decode(sample_ids, skip_special_tokens=True) == text
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in sample_logprobs)
            cut = len(sample_ids) == 10 and sample_ids[-1] != tokenizer.eos_token_id
            assert reason in ("stop", "length") and (reason == "length") == cut
    assert result.weights_dir == str(models["a"]) and result.weights_content_id and result.engine.startswith("vllm")
    assert result.timings.generate_s > 0


def test_a_seeded_request_repeats_and_its_prompts_draw_independent_samples(worker, models, client_for):
    """The same seeded request gives the same samples; the same prompt twice in it does not give
    the same samples twice (each prompt has a seed of its own, rollout_svc.engines.vllm_host's
    prompt_seed: with one seed for all, sample j of every prompt drew the same random numbers)."""
    client = client_for(worker["spool"].root)
    fields = dict(n_samples_per_prompt=4, max_tokens=10, temperature=1.0, seed=11)
    first = ask(client, models["a"], ["12+7=", "12+7="], **fields)
    again = ask(client, models["a"], ["12+7=", "12+7="], **fields)
    assert first.ok and again.ok
    assert first.token_ids == again.token_ids and first.logprobs == again.logprobs
    assert first.token_ids[0] != first.token_ids[1]


def test_prompt_seeds_make_a_prompts_samples_independent_of_its_request(worker, models, client_for):
    """With `prompt_seeds`, a prompt samples the same alone and third in a request of three (the
    position a turn gets in a batch of turns); with the request's `seed` instead, its position
    changes its seed, and so its samples."""
    client = client_for(worker["spool"].root)
    fields = dict(n_samples_per_prompt=2, max_tokens=10, temperature=1.0)
    alone = ask(client, models["a"], ["12+7="], prompt_seeds=[5], **fields)
    batched = ask(client, models["a"], ["Hello", "3+4=", "12+7="], prompt_seeds=[9, 8, 5], **fields)
    assert alone.ok and batched.ok
    assert batched.token_ids[2] == alone.token_ids[0]
    by_position = ask(client, models["a"], ["Hello", "3+4=", "12+7="], seed=5, **fields)
    assert by_position.ok and by_position.token_ids[2] != alone.token_ids[0]


def test_prompts_as_token_ids_give_the_same_greedy_output(worker, models, client_for):
    client = client_for(worker["spool"].root)
    by_text = ask(client, models["a"], ["12+7="])
    by_ids = ask(client, models["a"], prompts=(), prompt_token_ids=by_text.prompt_token_ids)
    assert by_ids.ok and by_ids.token_ids == by_text.token_ids


def test_a_prompt_that_extends_an_earlier_one_is_served_from_the_prefix_cache(worker, models, client_for):
    """The result says how many prompt tokens the engine's prefix cache served
    (`prompt_cached_tokens`): none for a prompt the worker has not seen, the earlier prompt's
    for one that extends it (an episode's next turn on the worker of its previous one)."""
    client = client_for(worker["spool"].root)
    draw = random.Random(time.time_ns())  # a prompt no other test sent
    first_ids = [draw.randrange(10, 120) for _ in range(MAX_MODEL_LEN // 2)]
    first = ask(client, models["a"], prompts=(), prompt_token_ids=[first_ids], max_tokens=4)
    assert first.ok and first.prompt_cached_tokens == [0]
    turn = first_ids + first.token_ids[0][0] + [draw.randrange(10, 120) for _ in range(6)]
    second = ask(client, models["a"], prompts=(), prompt_token_ids=[turn], max_tokens=4)
    assert second.ok
    assert 0 < second.prompt_cached_tokens[0] <= len(first_ids), second.prompt_cached_tokens


def test_sampling_logprobs_agree_with_transformers(worker, models, client_for, reference):
    client = client_for(worker["spool"].root)
    temperature = 0.8
    result = ask(
        client, models["a"], ["12+7=", "Hello", "abc"], n_samples_per_prompt=4, max_tokens=16,
        temperature=temperature, seed=3,
    )  # fmt: skip
    assert result.ok
    diffs = []
    for prompt_ids, samples, logprobs in zip(result.prompt_token_ids, result.token_ids, result.logprobs, strict=False):
        for sample_ids, sample_logprobs in zip(samples, logprobs, strict=False):
            expected = reference.token_logprobs(models["a"], prompt_ids, sample_ids, temperature)
            diffs += [abs(a - b) for a, b in zip(sample_logprobs, expected, strict=False)]
    mean = sum(diffs) / len(diffs)
    print(f"\nlogprob |vLLM - transformers| over {len(diffs)} tokens: max {max(diffs):.2e}, mean {mean:.2e}")
    assert max(diffs) < 1e-3


def test_reload_in_place_serves_the_new_weights(worker, models, client_for, reference):
    client = client_for(worker["spool"].root)
    prompt = "12+7="
    before = ask(client, models["a"], [prompt], max_tokens=12)
    after = ask(client, models["b"], [prompt], max_tokens=12)
    prompt_ids = after.prompt_token_ids[0]
    assert after.token_ids[0][0] == reference.greedy(models["b"], prompt_ids, 12)
    assert before.token_ids[0][0] == reference.greedy(models["a"], prompt_ids, 12)
    assert after.token_ids[0][0] != before.token_ids[0][0]
    assert after.weights_dir == str(models["b"]) and after.weights_content_id != before.weights_content_id
    # A reload, not a new engine: a small fraction of what building the engine took.
    assert 0 < after.timings.reload_s < worker["build_s"] / 20
    back = ask(client, models["a"], [prompt], max_tokens=12)
    assert back.token_ids == before.token_ids and back.timings.reload_s > 0


def test_same_path_with_new_content_is_reloaded(worker, models, client_for, reference, tmp_path):
    client = client_for(worker["spool"].root)
    moving = models["root"] / "moving"
    shutil.copytree(models["a"], moving)
    first = ask(client, moving, ["Hello"], max_tokens=10)
    # Replace the shard the way a careful writer does: a new file renamed over the old one.
    shutil.copy(models["b"] / "model.safetensors", moving / "model.safetensors.new")
    os.replace(moving / "model.safetensors.new", moving / "model.safetensors")
    second = ask(client, moving, ["Hello"], max_tokens=10)
    assert second.weights_content_id != first.weights_content_id
    assert second.token_ids[0][0] == reference.greedy(models["b"], second.prompt_token_ids[0], 10)
    assert second.timings.reload_s > 0


def test_architecture_change_rebuilds_the_engine(worker, models, client_for, reference):
    client = client_for(worker["spool"].root)
    result = ask(client, models["wide"], ["12+7="], max_tokens=10)
    assert result.ok, result.error
    assert result.token_ids[0][0] == reference.greedy(models["wide"], result.prompt_token_ids[0], 10)
    # A rebuild costs about a build, far more than an in-place reload.
    assert result.timings.reload_s > worker["build_s"] / 5
    again = ask(client, models["a"], ["12+7="], max_tokens=10)  # and back, rebuilding again
    assert again.ok and again.token_ids[0][0] == reference.greedy(models["a"], again.prompt_token_ids[0], 10)


def bad_weights(models, tmp_path) -> dict[str, tuple[str, ErrorCode, str]]:
    """name -> (weights_dir, expected code, a phrase the message must contain)."""
    root = models["root"]
    cases = {}
    outside = tmp_path / "outside"
    shutil.copytree(models["a"], outside)
    cases["outside"] = (outside, ErrorCode.WEIGHTS_NOT_ALLOWED, "allowed roots")
    cases["missing"] = (root / "does-not-exist", ErrorCode.WEIGHTS_NOT_FOUND, "does not exist")
    no_weights = root / "no-weights"
    no_weights.mkdir(exist_ok=True)
    shutil.copy(models["a"] / "config.json", no_weights)
    cases["no_weights"] = (no_weights, ErrorCode.WEIGHTS_INVALID, "no .safetensors")
    no_config = root / "no-config"
    shutil.copytree(models["a"], no_config, dirs_exist_ok=True)
    (no_config / "config.json").unlink()
    cases["no_config"] = (no_config, ErrorCode.WEIGHTS_INVALID, "config.json")
    truncated = root / "truncated"
    shutil.copytree(models["a"], truncated, dirs_exist_ok=True)
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(truncated / "model.safetensors") // 2)
    cases["corrupt_shard"] = (truncated, ErrorCode.WEIGHTS_INVALID, "not a valid safetensors")
    pickled = root / "pickled"
    pickled.mkdir(exist_ok=True)
    shutil.copy(models["a"] / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04 never unpickled")
    cases["pickle_only"] = (pickled, ErrorCode.WEIGHTS_INVALID, "pickle formats are never loaded")
    small_vocab = root / "small-vocab"
    shutil.copytree(models["a"], small_vocab, dirs_exist_ok=True)
    config = (small_vocab / "config.json").read_text().replace('"vocab_size": 128', '"vocab_size": 64')
    (small_vocab / "config.json").write_text(config)
    cases["vocab_too_small"] = (small_vocab, ErrorCode.WEIGHTS_INVALID, "vocab_size")
    return cases


def test_bad_weights_get_error_results_and_the_worker_keeps_serving(worker, models, client_for, tmp_path):
    client = client_for(worker["spool"].root)
    for name, (weights_dir, code, phrase) in bad_weights(models, tmp_path).items():
        result = ask(client, weights_dir)
        assert not result.ok and result.error.code == code, (name, result.error)
        assert phrase in result.error.message, (name, result.error.message)
        # Refused for its content: the request file is kept in bad/, not archived as served.
        request_id = result.request_id
        # Until the worker has let go of its claim (the result is published first, then the claim moved).
        kept = poll(
            lambda rid=request_id: worker["spool"].locate(rid),
            lambda paths: len(paths) == 2 and not any(p.parent.name == "claimed" for p in paths),
        )
        assert worker["spool"].bad_path(f"{request_id}.json") in kept, (name, kept)
    assert ask(client, models["a"]).ok
    status = wait_for_status(worker["spool"], WORKER, lambda s: True, 5)
    assert status.last_error and worker["proc"].poll() is None


def test_a_prompt_too_long_fails_alone(worker, models, client_for):
    client = client_for(worker["spool"].root)
    long_request = Request(
        request_id=f"long-{time.time_ns()}", weights_dir=str(models["a"]), prompts=["x" * 300],
        n_samples_per_prompt=1, max_tokens=8, temperature=0.0,
    )  # fmt: skip
    fine_request = Request(
        request_id=f"fine-{time.time_ns()}", weights_dir=str(models["a"]), prompts=["1+1="],
        n_samples_per_prompt=2, max_tokens=8, temperature=1.0,
    )  # fmt: skip
    client.submit_many([long_request, fine_request])  # one engine call, then each alone
    results = client.wait([long_request.request_id, fine_request.request_id], timeout_s=600)
    long_result, fine_result = results[long_request.request_id], results[fine_request.request_id]
    assert long_result.error.code == ErrorCode.PROMPT_TOO_LONG
    assert f"limit of {MAX_MODEL_LEN}" in long_result.error.message
    assert fine_result.ok and len(fine_result.texts[0]) == 2


def test_conversations_for_a_model_without_a_chat_template_fail_alone(worker, models, client_for):
    """The tiny model's tokenizer has no chat template: the chat request gets no_chat_template,
    naming the way out, and a text request served in the same engine call is answered."""
    client = client_for(worker["spool"].root)
    chat_request = Request(
        request_id=f"chat-{time.time_ns()}", weights_dir=str(models["a"]),
        messages=[[ChatTurn("user", "1+1=")]], n_samples_per_prompt=1, max_tokens=4, temperature=0.0,
    )  # fmt: skip
    text_request = Request(
        request_id=f"text-{time.time_ns()}", weights_dir=str(models["a"]), prompts=["1+1="],
        n_samples_per_prompt=1, max_tokens=4, temperature=0.0,
    )  # fmt: skip
    client.submit_many([chat_request, text_request])
    results = client.wait([chat_request.request_id, text_request.request_id], timeout_s=600)
    refused = results[chat_request.request_id]
    assert refused.error.code == ErrorCode.NO_CHAT_TEMPLATE
    assert "no chat template" in refused.error.message and "`prompts`" in refused.error.message
    assert results[text_request.request_id].ok
    # The request is at fault: kept in bad/ for its sender.
    assert poll(worker["spool"].bad_path(f"{chat_request.request_id}.json").exists, until=bool)


def test_expected_content_id_guards_against_a_replaced_directory(worker, models, client_for):
    client = client_for(worker["spool"].root)
    result = ask(client, models["a"], weights_content_id="some-other-checkpoint")
    assert result.error.code == ErrorCode.WEIGHTS_INVALID and "content id" in result.error.message


def test_metrics_textfile_counts_requests_and_errors(worker, models, client_for):
    client = client_for(worker["spool"].root)
    assert ask(client, models["a"]).ok
    assert ask(client, models["a"], weights_content_id="some-other-checkpoint").error.code == ErrorCode.WEIGHTS_INVALID
    path = worker["base"] / "metrics" / f"rollout_svc_{WORKER}.prom"
    counters = [
        f'rollout_requests_total{{outcome="ok",worker="{WORKER}"}}',
        f'rollout_errors_total{{code="weights_invalid",worker="{WORKER}"}}',
    ]
    # The worker rewrites the file on each turn of its loop: soon after it published the results.
    text = poll(lambda: path.read_text() if path.exists() else "", until=lambda text: all(c in text for c in counters))
    values = {}
    for line in text.splitlines():
        if line.startswith("rollout_"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert all(values.get(c, 0) >= 1 for c in counters), (counters, text)
    assert "rollout_reload_seconds" in text and "rollout_queue_depth" in text


def test_sigterm_while_generating_loses_nothing(worker, models, client_for):
    """It stops the shared worker; the next test that needs one starts it again."""
    spool, proc = worker["spool"], worker["proc"]
    client = client_for(spool.root)
    request = Request(
        request_id=f"slow-{time.time_ns()}", weights_dir=str(models["a"]), prompts=["1+1="] * 32,
        n_samples_per_prompt=8, max_tokens=200, temperature=1.0, seed=1,
    )  # fmt: skip
    client.submit(request)
    try:
        wait_for_status(
            spool, WORKER, lambda s: s.state == "generating" and s.current_request == request.request_id, 120, proc
        )
        assert stop_worker(proc) == 0
        result = spool.read_result(request.request_id)
        if result is not None:  # finished within the stop grace
            assert result.ok and len(result.texts) == 32
        else:  # or given back, whole, for another worker
            assert spool.request_path(request.request_id).exists()
        assert os.listdir(spool.claimed) == [] and not spool.status_path(WORKER).exists()
    finally:
        # Given back, it would keep the worker's next life busy for the tests after this one.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(spool.request_path(request.request_id))


REPUBLISHER = """
import json, os, shutil, sys, time
dest, a, b, stop = sys.argv[1:5]
i = 0
while not os.path.exists(stop):
    i += 1
    name, source = ("a", a) if i % 2 else ("b", b)
    staging = f"{dest}.staging"
    shutil.copytree(source, staging)
    with open(os.path.join(staging, "manifest.json"), "w") as f:
        json.dump({"content_id": f"{name}-{i}"}, f)
    if os.path.exists(dest):  # replace: the old version aside, the new one in, the old one deleted
        os.rename(dest, f"{dest}.old")
    os.rename(staging, dest)
    shutil.rmtree(f"{dest}.old", ignore_errors=True)
    if i % 7 == 0:  # now and then gone for a moment, as a pruned directory is
        os.rename(dest, f"{dest}.old")
        shutil.rmtree(f"{dest}.old")
    time.sleep(0.1 if i % 3 else 1.0)  # every third version stands long enough for a load to finish
if not os.path.exists(dest):  # stopped while it was gone: leave a version standing
    shutil.copytree(a, dest)
    with open(os.path.join(dest, "manifest.json"), "w") as f:
        json.dump({"content_id": "a-last"}, f)
"""


def test_a_directory_republished_while_the_worker_loads_it_is_never_served_torn(
    worker, models, client_for, reference, tmp_path
):
    """A writer republishes one directory over and over (models a and b in turn, each version
    with its own content id, now and then removed for a moment) while the worker serves
    requests naming it. Each answer comes from the version its content id names, or is a clean
    refusal (the directory was gone, or changed under every load); both versions are served while
    it changes; the engine never fails."""
    import subprocess
    import sys

    client = client_for(worker["spool"].root)
    dest = models["root"] / "republished"
    stop = tmp_path / "stop"
    writer = subprocess.Popen(
        [sys.executable, "-c", REPUBLISHER, str(dest), str(models["a"]), str(models["b"]), str(stop)]
    )
    served, refused = [], []
    try:
        for asked in range(96):
            if asked >= 24 and {"a", "b"} <= set(served):
                break
            result = ask(client, dest, ["12+7="], max_tokens=6)
            if not result.ok:
                refused.append(result.error.code)
                continue
            version = result.weights_content_id.split("-")[0]
            expected = reference.greedy(models[version], result.prompt_token_ids[0], 6)
            assert result.token_ids[0][0] == expected, f"served {result.weights_content_id} with other weights"
            served.append(version)
    finally:
        stop.touch()
        writer.wait(timeout=60)
    assert set(refused) <= {ErrorCode.WEIGHTS_NOT_FOUND, ErrorCode.WEIGHTS_INVALID}, refused
    # Served while it changed, both versions: refusing every load would pass nothing above.
    assert {"a", "b"} <= set(served), (served, refused)
    # Once the directory stands still, it is served: a refusal left nothing broken behind.
    last = ask(client, dest, ["12+7="], max_tokens=6)
    version = last.weights_content_id.split("-")[0]
    assert last.ok and last.token_ids[0][0] == reference.greedy(models[version], last.prompt_token_ids[0], 6)
    assert worker["proc"].poll() is None, (served, refused)


def test_a_file_linked_outside_the_roots_is_refused_and_the_worker_serves_on(worker, models, client_for, tmp_path):
    """`--allowed-root` holds for every file the worker reads, not only for the weights directory:
    a directory under the root whose shard, config or tokenizer is a symlink to a file outside is
    refused with `weights_not_allowed` before anything reads it, and the same worker serves on."""
    client = client_for(worker["spool"].root)
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        weights = shutil.copytree(models["a"], models["root"] / f"linked-{name}-{time.time_ns()}")
        target = outside / f"{weights.name}-{name}"
        os.rename(weights / name, target)
        os.symlink(target, weights / name)
        result = ask(client, weights)
        assert not result.ok, f"{name} linked outside the roots was served"
        assert result.error.code == ErrorCode.WEIGHTS_NOT_ALLOWED
        assert f"{name} resolves to {target}" in result.error.message and str(weights) in result.error.message
        # The request file moves to bad/ just after its result is published.
        assert poll(worker["spool"].bad_path(f"{result.request_id}.json").exists, until=bool)
    clean = ask(client, models["b"])
    assert clean.ok and clean.worker_id == WORKER and worker["proc"].poll() is None


# -- delta publishes (protocol.weights_chain): rebuilt by the worker, served like the full weights --


def _same_samples(client, delta_dir, full_dir):
    """The same seeded request on a delta publish and on the full weights of its step."""
    fields = dict(n_samples_per_prompt=4, max_tokens=12, temperature=1.0, seed=11)
    from_delta = ask(client, delta_dir, ["12+7=", "Hello"], **fields)
    from_full = ask(client, full_dir, ["12+7=", "Hello"], **fields)
    assert from_delta.ok, from_delta.error
    assert from_full.ok, from_full.error
    assert from_delta.weights_dir == str(delta_dir)
    assert from_delta.weights_content_id == manifest_of(delta_dir)["content_id"]
    assert from_delta.token_ids == from_full.token_ids
    assert from_delta.logprobs == from_full.logprobs  # bit for bit: the same weights in the same engine
    return from_delta


def test_a_chain_of_delta_publishes_is_served_exactly_as_the_full_weights(worker, models, client_for):
    client = client_for(worker["spool"].root)
    root = models["root"] / f"deltas-{time.time_ns()}"
    chain = Chain(models["a"], root / "published", root / "full")
    tensors = chain.tensors
    for step in (1, 2, 3):  # an anchor, then two deltas
        tensors = moved(tensors, 0.03, seed=step)
        chain.publish(step, tensors, full=step == 1)
    assert delta_bytes(chain.paths[3]) < (chain.full_paths[3] / "model.safetensors").stat().st_size / 4
    served = [_same_samples(client, chain.paths[step], chain.full_paths[step]) for step in (2, 3)]
    original = ask(client, models["a"], ["12+7=", "Hello"], n_samples_per_prompt=4, max_tokens=12, seed=11)
    assert original.token_ids != served[-1].token_ids  # the deltas changed the weights served
    assert served[-1].timings.reload_s > 0
    log = (worker["base"] / f"{WORKER}.log").read_text()
    assert f"rebuilt {chain.paths[2]} from {manifest_of(chain.paths[1])['content_id']} and 1 deltas" in log
    assert f"rebuilt {chain.paths[3]} from the weights held and 1 deltas" in log

    # A new anchor: the copy the worker holds (step 3) is not on step 5's chain, which starts there.
    for step in (4, 5):
        tensors = moved(tensors, 0.03, seed=step)
        chain.publish(step, tensors, full=step == 4)
    _same_samples(client, chain.paths[5], chain.full_paths[5])
    log = (worker["base"] / f"{WORKER}.log").read_text()
    assert f"rebuilt {chain.paths[5]} from {manifest_of(chain.paths[4])['content_id']} and 1 deltas" in log

    # Step 3 once its anchor and link are gone, on a worker holding step 5: a clear error, and the
    # worker serves on.
    shutil.rmtree(chain.paths[1])
    shutil.rmtree(chain.paths[2])
    failed = ask(client, chain.paths[3], ["12+7="])
    assert not failed.ok and failed.error.code == ErrorCode.WEIGHTS_NOT_FOUND
    assert "cannot be rebuilt" in failed.error.message
    assert manifest_of(chain.paths[3])["delta_base"] in failed.error.message  # the version the chain breaks at
    assert ask(client, chain.paths[5], ["12+7="]).ok


# The trainer's two publishes of one set of weights: a directory, and a slot of a ring (run in the
# trainer's venv, as the trainer runs them).
PUBLISH_BOTH = """
import sys
from pathlib import Path
from safetensors.torch import load_file
from trainer_svc.weights.publish import publish
from trainer_svc.weights.slots import SlotRing
from trainer_svc.weights.writer import as_stream

model, out = Path(sys.argv[1]), Path(sys.argv[2])
tensors = load_file(model / "model.safetensors")
published = publish(5, tensors, publish_dir=out / "weights", base_model=model)
ring = SlotRing(out / "ring", 2, spool_dir=None, wait_s=0)
slot = ring.write(ring.choose(), 5, "slots-step5", as_stream(tensors), None, model)
print(published.path, published.content_id, slot.path, slot.content_id)
"""


def test_a_request_naming_a_weight_slot_is_served_with_the_directory_publishs_weights(worker, models, client_for):
    from protocol.weight_slots import leases

    out = models["root"] / "slots"
    done = subprocess.run(
        [str(TRAINER_PYTHON), "-c", PUBLISH_BOTH, str(models["b"]), str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    directory, directory_id, slot, slot_id = done.stdout.split()
    client = client_for(worker["spool"].root)
    ask(client, models["a"], ["12+7="])  # the engine holds other weights first
    from_slot = ask(client, slot, ["12+7=", "Hello"], weights_content_id=slot_id, n_samples_per_prompt=2,
                    temperature=1.0, seed=11)  # fmt: skip
    from_directory = ask(client, directory, ["12+7=", "Hello"], weights_content_id=directory_id,
                         n_samples_per_prompt=2, temperature=1.0, seed=11)  # fmt: skip
    assert from_slot.ok, from_slot.error
    assert (from_slot.weights_dir, from_slot.weights_content_id) == (slot, slot_id)
    assert from_slot.timings.reload_s > 0
    # The same weights in the engine: the same samples and the same logprobs, bit for bit.
    assert from_slot.token_ids == from_directory.token_ids
    assert from_slot.logprobs == from_directory.logprobs
    assert leases(slot) == []  # the worker let go once its copy was made
    log = (worker["base"] / f"{WORKER}.log").read_text()
    assert f"slot {slot} (step 5" in log  # loaded as a slot, not read as files
    stale = ask(client, slot, weights_content_id="slots-step4")
    assert stale.error.code == ErrorCode.WEIGHTS_INVALID and "content id" in stale.error.message


def test_a_corrupt_slot_is_a_permanent_weights_invalid_and_the_worker_serves_on(worker, models, client_for):
    """A byte of tensors.bin changed after its manifest was written: the copy's sum differs from
    the checksum. Sent again, the same bytes fail again, so it is weights_invalid (the trainer's
    client stops at once on it, exit 2: tests/trainer/test_rollout_service.py), never an
    engine_error that the trainer resends, each time with an engine rebuild."""
    from protocol.weight_slots import SLOT_DATA, leases, read_slot_manifest

    out = models["root"] / "corrupt-slot"
    done = subprocess.run(
        [str(TRAINER_PYTHON), "-c", PUBLISH_BOTH, str(models["b"]), str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    _, _, slot, slot_id = done.stdout.split()
    middle = read_slot_manifest(slot).bytes // 2
    with open(Path(slot) / SLOT_DATA, "r+b") as f:  # in place: the same file, one byte flipped
        f.seek(middle)
        byte = f.read(1)[0]
        f.seek(middle)
        f.write(bytes([byte ^ 0xFF]))
    client = client_for(worker["spool"].root)
    assert ask(client, models["a"], ["12+7="]).ok  # the engine holds other weights of the same shape first
    log_path = worker["base"] / f"{WORKER}.log"
    log_before = len(log_path.read_text())
    failed = ask(client, slot, ["12+7="], weights_content_id=slot_id)
    assert not failed.ok and failed.error.code == ErrorCode.WEIGHTS_INVALID, failed.error
    assert not failed.error.code.transient  # permanent: the trainer does not send it again
    assert "sums to" in failed.error.message and slot in failed.error.message
    assert "building a new engine" not in log_path.read_text()[log_before:]  # no rebuild for bad bytes
    assert leases(slot) == []
    assert worker["proc"].poll() is None
    served = ask(client, models["a"], ["12+7="])  # the worker serves on, with sound weights
    assert served.ok and served.weights_dir == str(models["a"]), served.error
