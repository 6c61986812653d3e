"""What one request may ask of a worker (rollout_svc.request_limits), answers that cannot be
published as they are, and weights directories holding files no reader may open: an in-process
worker on the echo engine, real files, FIFOs and links."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import tomllib

from protocol.messages import ErrorCode, Request
from rollout_svc.engines.echo import EchoEngine
from rollout_svc.errors import RequestFailed
from rollout_svc.request_limits import RequestLimits
from rollout_svc.weights import WeightsPolicy

pytestmark = pytest.mark.timeout(60)
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def wait_results(spool, wait_for, ids, timeout=15.0):
    wait_for(lambda: all(spool.has_result(i) for i in ids), timeout=timeout, what=f"results of {ids}")
    return {i: spool.read_result(i) for i in ids}


@pytest.mark.parametrize(
    ("fields", "option"),
    [
        ({"n_samples_per_prompt": 1_000_000}, "--max-samples"),
        ({"prompts": ["x"] * 5000}, "--max-prompts"),
        ({"prompts": ["x"] * 64, "n_samples_per_prompt": 64, "max_tokens": 1025}, "--max-request-tokens"),
    ],
)
def test_a_request_over_a_limit_is_refused_naming_the_option(spool, make_request, run_worker, wait_for, fields, option):
    spool.submit_many([make_request("huge", **fields), make_request("fine")])
    handle = run_worker(spool)
    results = wait_results(spool, wait_for, ["huge", "fine"])
    huge = results["huge"]
    assert not huge.ok and huge.error.code is ErrorCode.REQUEST_TOO_LARGE
    assert option in huge.error.message and huge.texts == []
    assert results["fine"].ok
    assert not ErrorCode.REQUEST_TOO_LARGE.transient  # the trainer does not resend it
    wait_for(lambda: (spool.bad / "huge.json").exists(), what="the refused request kept in bad/")
    assert handle.thread.is_alive()


def test_the_limits_are_options(spool, make_request, run_worker, wait_for):
    spool.submit(make_request("many", n_samples_per_prompt=3000, max_tokens=1))
    run_worker(spool, request_limits=RequestLimits(max_samples=4096))
    assert wait_results(spool, wait_for, ["many"])["many"].ok


def test_a_result_over_the_byte_limit_is_replaced_by_an_error(spool, make_request, run_worker, wait_for):
    spool.submit_many([make_request("big", prompts=["y" * 5000], max_tokens=5000), make_request("small")])
    run_worker(spool, request_limits=RequestLimits(max_result_bytes=20_000))
    results = wait_results(spool, wait_for, ["big", "small"])
    assert results["big"].error.code is ErrorCode.REQUEST_TOO_LARGE
    assert "--max-result-bytes" in results["big"].error.message
    assert results["small"].ok


class SurrogateEngine(EchoEngine):
    """The echo, answering the prompt "bad" with text no encoder can write (a lone surrogate)."""

    def generate(self, requests: list[Request]):
        completions = super().generate(requests)
        for request, completion in zip(requests, completions, strict=True):
            if request.prompts == ["bad"]:
                completion.texts = [["\ud800"] * request.n_samples_per_prompt]
        return completions


def test_an_unencodable_answer_fails_only_its_request(spool, make_request, run_worker, wait_for):
    spool.submit_many([make_request("a"), make_request("bad", prompts=["bad"]), make_request("b")])
    handle = run_worker(spool, SurrogateEngine())
    results = wait_results(spool, wait_for, ["a", "bad", "b"])
    assert results["a"].ok and results["b"].ok
    assert results["bad"].error.code is ErrorCode.ENGINE_ERROR
    assert "cannot be encoded" in results["bad"].error.message
    assert handle.thread.is_alive()


def test_the_echo_refuses_token_ids_naming_surrogates(spool, make_request, run_worker, wait_for):
    spool.submit_many([make_request("lone", prompts=[], prompt_token_ids=[[55296, 65]]), make_request("ok")])
    handle = run_worker(spool)
    results = wait_results(spool, wait_for, ["lone", "ok"])
    assert results["lone"].error.code is ErrorCode.INVALID_REQUEST
    assert "55296" in results["lone"].error.message and "surrogate" in results["lone"].error.message
    assert results["ok"].ok
    assert handle.thread.is_alive()


def test_the_shipped_configs_ask_far_less_than_the_default_limits():
    """Each config's training request (a step's prompts in one request, the worst case of the
    fan-out), its band request (64 prompts) and an eval request (64 prompts) fit the defaults
    with room to spare (a tenth)."""
    limits = RequestLimits()
    configs = sorted(CONFIGS.glob("*.toml"))
    assert configs
    for path in configs:
        config = tomllib.loads(path.read_text())
        rollout = config.get("rollout", {})
        prompts, samples = rollout.get("prompts_per_step", 16), rollout.get("samples_per_prompt", 8)
        max_tokens = rollout.get("max_tokens", 4)
        band_samples = config.get("band", {}).get("samples", 16)
        for asked_prompts, asked_samples in ((prompts, samples), (64, band_samples), (64, 1)):
            assert asked_prompts * 10 <= limits.max_prompts, path
            assert asked_samples * 10 <= limits.max_samples, path
            assert asked_prompts * asked_samples * max_tokens * 10 <= limits.max_request_tokens, path


# -- weights directories with files no reader may open -----------------------------------------------


def inspect_within(policy: WeightsPolicy, path: Path, timeout_s: float = 20.0) -> RequestFailed:
    """policy.inspect(path) in a thread: it must refuse within the bound, not hang or read on."""
    outcome: list[BaseException | object] = []
    thread = threading.Thread(target=lambda: outcome.append(_refusal(policy, path)), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"inspecting {path} did not return within {timeout_s} s"
    assert isinstance(outcome[0], RequestFailed), outcome
    return outcome[0]


def _refusal(policy: WeightsPolicy, path: Path):
    try:
        return policy.inspect(str(path))
    except RequestFailed as exc:
        return exc


@pytest.mark.parametrize("name", ["manifest.json", "config.json", "tokenizer.json"])
def test_a_fifo_in_a_weights_directory_is_refused_before_anyone_opens_it(tmp_path, name):
    weights = tmp_path / "weights"
    weights.mkdir()
    os.mkfifo(weights / name)
    refused = inspect_within(WeightsPolicy(), weights)
    assert refused.code is ErrorCode.WEIGHTS_INVALID and f"{name} is a FIFO" in refused.message


def test_a_link_to_a_device_is_refused(tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    os.symlink("/dev/zero", weights / "manifest.json")
    refused = inspect_within(WeightsPolicy(), weights)
    assert refused.code is ErrorCode.WEIGHTS_INVALID and "manifest.json is a device" in refused.message
    within_roots = inspect_within(WeightsPolicy([str(tmp_path)]), weights)
    assert within_roots.code is ErrorCode.WEIGHTS_NOT_ALLOWED and "/dev/zero" in within_roots.message


def test_a_config_over_its_bound_is_refused(tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    with open(weights / "config.json", "wb") as f:  # sparse: no disk, no write time
        f.truncate(17 * 2**20)
    refused = inspect_within(WeightsPolicy(), weights)
    assert refused.code is ErrorCode.WEIGHTS_INVALID and "larger than" in refused.message


def test_a_symlinked_file_inside_the_roots_still_loads(tmp_path):
    """A Hugging Face cache's snapshot links each file into its blobs: resolved, then read."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    (blobs / "cfg").write_text('{"model_type": "llama"}')
    os.symlink(blobs / "cfg", snapshot / "config.json")
    refused = inspect_within(WeightsPolicy([str(tmp_path)]), snapshot)
    assert refused.code is ErrorCode.WEIGHTS_INVALID and "no .safetensors" in refused.message  # config was read
