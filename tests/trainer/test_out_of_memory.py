"""A step that runs out of device memory stops the run with exit 71 and a message naming the step,
its phase and what to change; the relaunch resumes from the newest checkpoint and takes the same
steps as a run never stopped. The device's refusal is played by raising the error torch raises
for it (torch.OutOfMemoryError) from the step's log-prob pass: a CPU cannot run out of device
memory on cue."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_config
from local_sampler import TorchSampler
from typer.testing import CliRunner

from protocol import exit_codes
from trainer_svc.learning import train_step
from trainer_svc.run.loop import train
from trainer_svc.run.out_of_memory import OutOfDeviceMemory

TIMING_KEYS = {"rollout_s", "generate_s", "score_s", "train_s", "publish_s", "save_s", "step_s"}


def run(cfg) -> int:
    return train(cfg, make_sampler=lambda cfg, launch_id: TorchSampler(cfg))


def rows(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines if line]


@pytest.mark.timeout(300)
def test_a_step_out_of_device_memory_stops_naming_it_and_the_relaunch_takes_the_same_steps(
    warm_model, tmp_path, monkeypatch
):
    straight = make_config(tmp_path / "straight", warm_model, train={"steps": 4})
    assert run(straight) == exit_codes.OK

    cfg = make_config(tmp_path / "oom", warm_model, train={"steps": 4})
    real, calls = train_step.sequence_logprobs, []
    forwards_per_step = 2  # train.grad_accum micro-batches, one forward each

    def third_step_runs_out(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 * forwards_per_step + 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(train_step, "sequence_logprobs", third_step_runs_out)
    with pytest.raises(OutOfDeviceMemory) as stopped:
        run(cfg)
    message = str(stopped.value)
    assert "step 3's train" in message and "Tried to allocate 12.00 GiB" in message
    assert "train.max_tokens_per_micro_batch" in message and "checkpoint step_00000002" in message
    assert len(rows(cfg.run_dir)) == 2  # nothing of the step the error cut

    monkeypatch.setattr(train_step, "sequence_logprobs", real)
    assert run(cfg) == exit_codes.OK
    assert rows(cfg.run_dir) == rows(straight.run_dir)


def test_the_cli_exits_71_with_the_message(tmp_path, monkeypatch):
    import trainer_svc.run.loop as loop
    from trainer_svc.cli import app

    def out_of_memory(cfg, stage):
        raise OutOfDeviceMemory(7, "train", torch.device("cpu"), "step_00000006", "CUDA out of memory.")

    monkeypatch.setattr(loop, "train", out_of_memory)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"")
    config = tmp_path / "run.toml"
    config.write_text(f'[run]\ndir = "{tmp_path / "run"}"\n[model]\npath = "{model}"\n[rollout]\nspawn = false\n')
    monkeypatch.setattr("trainer_svc.cli.check_before_work", lambda cfg, **kw: None)
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == exit_codes.OUT_OF_MEMORY, result.output
    assert "out of memory on cpu in step 7's train" in result.output
    assert "resumes from checkpoint step_00000006" in result.output
