"""Preflight: a bad model directory, an unwritable run directory or an unusable spool fails at
once, with a message that says what to fix and the exit code scripts branch on."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import msgspec
import pytest

from protocol import exit_codes
from protocol.messages import WorkerStatus
from protocol.spool import Spool
from trainer_svc.config import Config
from trainer_svc.rails.preflight import PreflightError, check_model_dir, check_run_dir, check_spool


def make_config(tmp_path: Path, **rollout) -> Config:
    return msgspec.convert(
        {"run": {"dir": str(tmp_path / "run")}, "model": {"path": str(tmp_path / "model")}, "rollout": rollout},
        Config,
    )


def fake_model(path: Path) -> Path:
    """Enough of an HF directory for the preflight (which never opens the weights)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(b"")
    return path


def fake_venv(path: Path) -> Path:
    executable = path / "bin" / "rollout-svc"
    executable.parent.mkdir(parents=True)
    executable.write_text("#!/bin/sh\nexit 0\n")
    executable.chmod(0o755)
    return path


def status(worker_id: str, lease_s: float = 30.0) -> WorkerStatus:
    now = time.time()
    return WorkerStatus(
        worker_id=worker_id,
        pid=os.getpid(),
        host=socket.gethostname(),
        device="cpu",
        engine="echo",
        state="idle",
        lease_s=lease_s,
        started_at=now,
        heartbeat_at=now,
    )


# ---------------------------------------------------------------- model directory


def test_model_dir_accepted(tmp_path):
    check_model_dir(fake_model(tmp_path / "model"))


def test_model_dir_missing(tmp_path):
    with pytest.raises(PreflightError) as info:
        check_model_dir(tmp_path / "nowhere")
    assert info.value.exit_code == exit_codes.USAGE
    assert f"model directory {tmp_path / 'nowhere'} does not exist (model.path)" in str(info.value)


def test_model_dir_without_config(tmp_path):
    model = fake_model(tmp_path / "model")
    (model / "config.json").unlink()
    with pytest.raises(PreflightError) as info:
        check_model_dir(model)
    assert info.value.exit_code == exit_codes.USAGE
    assert f"{model} has no config.json" in str(info.value)


def test_model_dir_config_not_json(tmp_path):
    model = fake_model(tmp_path / "model")
    (model / "config.json").write_text('{"model_type": "llama",')  # truncated
    with pytest.raises(PreflightError) as info:
        check_model_dir(model)
    assert info.value.exit_code == exit_codes.USAGE
    assert f"{model}/config.json is not valid JSON" in str(info.value)


def test_model_dir_with_only_pickle_weights(tmp_path):
    model = fake_model(tmp_path / "model")
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(PreflightError) as info:
        check_model_dir(model)
    assert info.value.exit_code == exit_codes.USAGE
    assert f"{model} (model.path) has no .safetensors weights" in str(info.value)
    assert "safe_serialization=True" in str(info.value)


# ---------------------------------------------------------------- run directory


def test_run_dir_created_and_left_clean(tmp_path):
    run_dir = tmp_path / "a" / "b" / "run"
    check_run_dir(run_dir)
    assert run_dir.is_dir() and list(run_dir.iterdir()) == []  # the write probe is gone


def test_run_dir_under_a_regular_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(PreflightError) as info:
        check_run_dir(blocker / "run")
    assert info.value.exit_code == exit_codes.USAGE
    assert f"run directory {blocker / 'run'} cannot be written" in str(info.value)
    assert "run.dir" in str(info.value)


def test_publish_dir_under_a_regular_file_names_its_key(tmp_path):
    from trainer_svc.rails.preflight import check_publish_dir

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(PreflightError) as info:
        check_publish_dir(blocker / "weights")
    assert f"publish directory {blocker / 'weights'} cannot be written" in str(info.value)
    assert "choose another publish.dir" in str(info.value)


# ---------------------------------------------------------------- spool


def test_spawn_with_a_rollout_venv_passes(tmp_path):
    check_spool(make_config(tmp_path, rollout_venv=str(fake_venv(tmp_path / "venv"))))
    assert (tmp_path / "run" / "spool").is_dir()  # default spool: <run.dir>/spool


def test_spawn_with_a_missing_rollout_venv(tmp_path):
    with pytest.raises(PreflightError) as info:
        check_spool(make_config(tmp_path, rollout_venv=str(tmp_path / "no-venv")))
    assert info.value.exit_code == exit_codes.ROLLOUT_UNAVAILABLE
    assert f"{tmp_path / 'no-venv' / 'bin' / 'rollout-svc'} is missing" in str(info.value)
    assert "rollout.rollout_venv" in str(info.value)


def test_spool_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(PreflightError) as info:
        check_spool(make_config(tmp_path, spool=str(blocker / "spool"), rollout_venv=str(fake_venv(tmp_path / "venv"))))
    assert info.value.exit_code == exit_codes.ROLLOUT_UNAVAILABLE
    assert f"spool {blocker / 'spool'} is unusable" in str(info.value)


def test_no_spawn_and_no_live_worker(tmp_path):
    spool = Spool(tmp_path / "spool", create=True)
    spool.write_status(status("gone", lease_s=5.0))
    stale = time.time() - 60
    os.utime(spool.workers / "gone.json", (stale, stale))  # its heartbeat stopped a minute ago
    with pytest.raises(PreflightError) as info:
        check_spool(make_config(tmp_path, spool=str(spool.root), spawn=False))
    message = str(info.value)
    assert info.value.exit_code == exit_codes.ROLLOUT_UNAVAILABLE
    assert f"no live worker serves {spool.root}" in message
    assert f"rollout-svc serve --spool {spool.root}" in message and "systemctl start rollout-svc@0" in message
    assert "rollout.spawn = true" in message


def test_no_spawn_and_a_spool_without_its_layout(tmp_path):
    """A directory no worker ever served: still ROLLOUT_UNAVAILABLE, and it says how to fix it."""
    with pytest.raises(PreflightError) as info:
        check_spool(make_config(tmp_path, spool=str(tmp_path / "fresh"), spawn=False))
    assert info.value.exit_code == exit_codes.ROLLOUT_UNAVAILABLE
    assert str(tmp_path / "fresh") in str(info.value) and "rollout-svc serve" in str(info.value)


def test_no_spawn_with_a_live_worker_passes(tmp_path):
    spool = Spool(tmp_path / "spool", create=True)
    spool.write_status(status("host-gpu0"))
    check_spool(make_config(tmp_path, spool=str(spool.root), spawn=False, rollout_venv=str(tmp_path / "no-venv")))
