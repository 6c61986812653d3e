"""spoolctl, driven as an operator would, against a real spool and a real echo worker; and
`rollout-svc`'s option defaults, refusals and exit codes."""

from __future__ import annotations

import inspect
import json
import os
import time
import types

import pytest
from typer.testing import CliRunner

import rollout_svc.cli as rollout_cli
import rollout_svc.worker as worker_module
from protocol import exit_codes
from protocol.cli import app, format_age, parse_duration
from protocol.messages import Request, WorkerStatus
from protocol.spool import Spool
from rollout_svc.engines.vllm import VllmEngine
from rollout_svc.worker import WorkerConfig

runner = CliRunner()


def request(request_id: str, **overrides) -> Request:
    fields = dict(
        request_id=request_id,
        weights_dir="/models/m",
        prompts=["2+2="],
        n_samples_per_prompt=1,
        max_tokens=4,
        temperature=0.0,
    )
    return Request(**(fields | overrides))


def invoke(spool: Spool, *args: str):
    result = runner.invoke(app, [args[0], "--spool", str(spool.root), *args[1:]])
    return result


@pytest.fixture
def spool(tmp_path):
    return Spool(tmp_path / "spool", create=True)


def write_status(spool: Spool, worker_id: str, *, age_s: float = 0.0, lease_s: float = 30.0, state="idle"):
    now = time.time()
    status = WorkerStatus(
        worker_id=worker_id,
        pid=123,
        host="h",
        device="cpu",
        engine="echo",
        state=state,
        lease_s=lease_s,
        started_at=now,
        heartbeat_at=now,
    )
    spool.write_status(status)
    path = spool.workers / f"{worker_id}.json"
    os.utime(path, (now - age_s, now - age_s))


def test_init_creates_the_layout(tmp_path):
    result = runner.invoke(app, ["init", str(tmp_path / "s")])
    assert result.exit_code == 0
    assert sorted(os.listdir(tmp_path / "s")) == sorted(
        ["tmp", "requests", "claimed", "results", "done", "bad", "workers"]
    )


def test_a_directory_that_is_not_a_spool_is_named_with_the_fix(tmp_path):
    result = runner.invoke(app, ["stats", "--spool", str(tmp_path)])
    assert result.exit_code == 2
    assert "spoolctl init" in result.output


def test_ls_lists_by_state_with_ages_and_json(spool):
    spool.submit(request("a"))
    spool.submit(request("b"))
    human = invoke(spool, "ls", "requests")
    assert human.exit_code == 0
    assert "requests/ (2)" in human.output and "a.json" in human.output
    data = json.loads(invoke(spool, "ls", "requests", "bad", "--json").output)
    assert [e["name"] for e in data["requests"]] == ["a.json", "b.json"]
    assert data["bad"] == [] and all(e["age_s"] >= 0 for e in data["requests"])


def test_ls_refuses_an_unknown_state(spool):
    result = invoke(spool, "ls", "nowhere")
    assert result.exit_code != 0 and "unknown state" in result.output


def test_show_finds_every_file_of_an_id(spool):
    spool.submit(request("a"))
    data = json.loads(invoke(spool, "show", "a", "--json").output)
    assert data == {"requests/a.json": json.loads((spool.requests / "a.json").read_bytes())}
    missing = invoke(spool, "show", "zzz")
    assert missing.exit_code == 1 and "no file of request 'zzz'" in missing.output


def test_stats_counts_states_and_tells_live_from_dead_workers(spool):
    spool.submit(request("a"))
    write_status(spool, "alive", age_s=1)
    write_status(spool, "gone", age_s=100, lease_s=30)
    data = json.loads(invoke(spool, "stats", "--json").output)
    assert data["counts"]["requests"] == 1
    assert data["oldest_request_age_s"] >= 0
    assert {w["worker_id"]: w["live"] for w in data["workers"]} == {"alive": True, "gone": False}
    assert data["live_workers"] == 1
    human = invoke(spool, "stats")
    assert human.exit_code == 0 and "DEAD" in human.output and "1 live" in human.output


def test_recover_gives_dead_claims_back(spool):
    spool.submit(request("a"))
    claim = spool.claim(spool.pending()[0], "gone")
    write_status(spool, "gone", age_s=100, lease_s=1.0)  # recover watches the heartbeat for half the lease
    result = invoke(spool, "recover")
    assert result.exit_code == 0 and "recovered 1 claims: a.json" in result.output
    assert not claim.path.exists() and (spool.requests / "a.json").exists()


def test_requeue_from_bad_archives_the_old_result(spool):
    spool.submit(request("a"))
    claim = spool.claim(spool.pending()[0], "w")
    from protocol.messages import ErrorCode, MessageError

    spool.reject(claim, MessageError(ErrorCode.INVALID_REQUEST, "broken"), "w")
    assert spool.has_result("a")
    result = invoke(spool, "requeue", "a")
    assert result.exit_code == 0 and "from bad/" in result.output
    assert (spool.requests / "a.json").exists()
    assert not spool.has_result("a")  # otherwise a worker would skip it
    assert any(name.startswith("a.result.superseded-") for name in os.listdir(spool.done))


def test_requeue_refuses_a_live_claim_unless_forced(spool):
    spool.submit(request("a"))
    spool.claim(spool.pending()[0], "busy")
    write_status(spool, "busy", age_s=0)
    refused = invoke(spool, "requeue", "a")
    assert refused.exit_code == 1 and "live worker busy" in refused.output and "--force" in refused.output
    forced = invoke(spool, "requeue", "a", "--force")
    assert forced.exit_code == 0 and (spool.requests / "a.json").exists()


def test_requeue_of_a_queued_or_unknown_request_is_refused(spool):
    spool.submit(request("a"))
    assert "already waiting" in invoke(spool, "requeue", "a").output
    assert "submit it again" in invoke(spool, "requeue", "nope").output


def test_prune_removes_only_old_entries(spool):
    (spool.done / "a.request.json").write_text("{}")
    (spool.tmp / "leftover.tmp").write_text("")
    result = invoke(spool, "prune", "--older-than", "1d")
    assert result.exit_code == 0 and "removed 0 from done/, 0 from tmp/" in result.output
    two_days_later = time.time() + 2 * 86400
    assert spool.prune(done_older_than_s=86400, now=two_days_later) == {"done": 1, "tmp": 1, "workers": 0}
    assert os.listdir(spool.done) == [] and os.listdir(spool.tmp) == []


@pytest.mark.parametrize(
    "text, seconds", [("90", 90), ("90s", 90), ("15m", 900), ("2h", 7200), ("7d", 604800), ("1.5h", 5400)]
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


def test_parse_duration_refuses_nonsense():
    import typer

    with pytest.raises(typer.BadParameter, match="not a duration"):
        parse_duration("soon")


def test_format_age():
    assert (
        format_age(5) == "5.0s"
        and format_age(120) == "2.0m"
        and format_age(7200) == "2.0h"
        and format_age(2 * 86400) == "2.0d"
    )


# -- rollout-svc ---------------------------------------------------------------------------------


@pytest.fixture
def served(monkeypatch):
    """`rollout-svc serve` with a Worker that records its config and exits with `served.rc`."""
    record = types.SimpleNamespace(configs=[], rc=exit_codes.OK)

    class FakeWorker:
        def __init__(self, spool, engine, config, **_options):
            record.configs.append(config)

        def serve(self) -> int:
            return record.rc

    monkeypatch.setattr(worker_module, "Worker", FakeWorker)
    return record


def rollout_svc(*args: str):
    return runner.invoke(rollout_cli.app, list(args))


def test_serve_without_options_runs_the_worker_with_its_own_defaults(tmp_path, served):
    result = rollout_svc("serve", "--spool", str(tmp_path / "s"), "--engine", "echo", "--worker-id", "w1")
    assert result.exit_code == exit_codes.OK, result.output
    assert served.configs == [WorkerConfig(worker_id="w1")]


def test_serve_exits_with_the_workers_code(tmp_path, served):
    served.rc = exit_codes.INTERNAL_ERROR
    result = rollout_svc("serve", "--spool", str(tmp_path / "s"), "--engine", "echo")
    assert result.exit_code == exit_codes.INTERNAL_ERROR


def test_serve_vllm_options_default_to_the_engines_own():
    options = inspect.signature(rollout_cli.serve).parameters
    engine = inspect.signature(VllmEngine).parameters
    for name in ("dtype", "max_model_len", "kv_cache_gib", "gpu_memory_utilization", "enforce_eager", "seed"):
        assert options[name].default == engine[name].default, name


def test_serve_passes_sleep_when_idle_to_the_worker(tmp_path, served):
    result = rollout_svc(
        "serve", "--spool", str(tmp_path / "s"), "--engine", "echo", "--worker-id", "w1", "--sleep-when-idle", "30"
    )
    assert result.exit_code == exit_codes.OK, result.output
    assert served.configs == [WorkerConfig(worker_id="w1", sleep_when_idle_s=30.0)]


def test_serve_passes_the_sticky_wait_to_the_scheduler_and_refuses_a_negative_one(tmp_path, served):
    base = ("serve", "--spool", str(tmp_path / "s"), "--engine", "echo", "--worker-id", "w1")
    result = rollout_svc(*base, "--sticky-wait-s", "0.5")
    assert result.exit_code == exit_codes.OK, result.output
    assert [c.limits.sticky_wait_s for c in served.configs] == [0.5]
    result = rollout_svc(*base, "--sticky-wait-s", "-1")
    assert result.exit_code == exit_codes.USAGE and "--sticky-wait-s" in result.output and len(served.configs) == 1


def test_serve_refuses_sleep_on_cpu_naming_the_option(tmp_path, served, monkeypatch):
    monkeypatch.setattr(rollout_cli, "_device", lambda engine: "cpu")
    result = rollout_svc("serve", "--spool", str(tmp_path / "s"), "--engine", "vllm", "--sleep-when-idle", "30")
    assert result.exit_code == exit_codes.USAGE
    assert "--sleep-when-idle" in result.output and "CPU build" in result.output and served.configs == []


def test_vllm_cpu_build_has_no_sleep_mode(tmp_path):
    """Why sleep is refused on CPU: vLLM's CPU build refuses it. When a CPU build accepts it, this
    fails, and VllmEngine's refusal should go. (With vLLM's GPU build installed, its platform
    must offer sleep mode instead.)"""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from rollout_svc.tiny_model import build

    if not current_platform.is_cpu():
        assert current_platform.is_sleep_mode_available()
        return
    model = build(tmp_path / "m")
    with pytest.raises(Exception, match="Sleep mode is not supported"):
        EngineArgs(model=str(model), enable_sleep_mode=True, max_model_len=64).create_engine_config()


@pytest.mark.parametrize(
    "args, named",
    [
        (["--heartbeat", "11", "--lease", "30"], "--lease"),
        (["--engine", "nope"], "--engine"),
        (["--worker-id", "a b"], "--worker-id"),
        (["--allowed-root", "/does/not/exist"], "--allowed-root"),
        (["--sleep-level", "3"], "--sleep-level"),
        (["--sleep-when-idle", "-1"], "--sleep-when-idle"),
    ],
)
def test_serve_refusals_name_the_option_and_exit_usage(tmp_path, served, args, named):
    result = rollout_svc("serve", "--spool", str(tmp_path / "s"), "--engine", "echo", *args)
    assert result.exit_code == exit_codes.USAGE
    assert named in result.output and served.configs == []


def test_serve_refuses_a_spool_it_cannot_use_naming_the_option(tmp_path, served):
    (tmp_path / "file").write_text("")
    result = rollout_svc("serve", "--spool", str(tmp_path / "file"), "--engine", "echo")
    assert result.exit_code == exit_codes.USAGE
    assert f"cannot use --spool {tmp_path / 'file'}" in result.output and served.configs == []


def test_tiny_model_refusals_exit_usage_and_name_what_to_change(tmp_path):
    (tmp_path / "taken").mkdir()
    taken = rollout_svc("tiny-model", str(tmp_path / "taken"))
    assert taken.exit_code == exit_codes.USAGE and "exists; remove it or name another directory" in taken.output
    odd = rollout_svc("tiny-model", str(tmp_path / "odd"), "--hidden", "100")
    assert odd.exit_code == exit_codes.USAGE and "--hidden" in odd.output
    assert not (tmp_path / "odd").exists()


@pytest.mark.parametrize("target", [None, "cpu", "cuda"])
def test_the_worker_tells_the_device_as_vllm_does_without_importing_it(target):
    """The serve command decides CPU or GPU from the package metadata, in a fresh interpreter that
    never imports vLLM; vLLM's own platform detection must agree, in this venv, whatever
    VLLM_TARGET_DEVICE says."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    if target:
        env["VLLM_TARGET_DEVICE"] = target
    ours = "import sys, rollout_svc.cli as c; print(c.vllm_is_cpu_build(), 'vllm' in sys.modules)"
    theirs = "from vllm.platforms import cpu_platform_plugin; print(cpu_platform_plugin() is not None)"
    answers = [
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
        for code in (ours, theirs)
    ]
    assert answers[0] == [answers[1][0], "False"]
