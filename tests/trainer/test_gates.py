"""Launch gates: each refuses a crafted bad case with GateRefused (exit code 3) and a message
naming what to change, and lets the good case through; through the CLI a refusal exits 3
before any checkpoint is written or any rollout worker is started."""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from pathlib import Path

import msgspec
import pytest
from conftest import ROOT, make_config
from typer.testing import CliRunner

from protocol import exit_codes
from protocol.messages import WorkerStatus
from protocol.weights_dir import weights_content_id
from trainer_svc.cli import app
from trainer_svc.data import Problem, arithmetic_problems
from trainer_svc.learning.rewards import Verifier
from trainer_svc.rails import gates
from trainer_svc.rails.gates import GateRefused

ROLLOUT_VENV = ROOT / ".venvs" / "rollout"


def refused(gate: str, call, *args, **kwargs) -> str:
    """Run a gate that must refuse; return its message."""
    with pytest.raises(GateRefused) as info:
        call(*args, **kwargs)
    assert info.value.gate == gate
    assert info.value.exit_code == exit_codes.GATE_REFUSED == 3
    message = str(info.value)
    assert message.startswith(f"launch gate '{gate}' refused the run: ")
    return message


def replace(cfg, **sections):
    """cfg with some fields of some sections replaced: replace(cfg, train={"steps": 3})."""
    return msgspec.structs.replace(
        cfg, **{name: msgspec.structs.replace(getattr(cfg, name), **values) for name, values in sections.items()}
    )


@pytest.fixture()
def cfg(tmp_path, tiny_model):
    return make_config(tmp_path / "run", tiny_model)


# -- config --------------------------------------------------------------------------------------


def test_config_refuses_a_batch_that_does_not_split_into_ranks_and_micro_batches(cfg):
    # 4 prompts x 4 samples = 16 sequences; grad_accum 2
    gates.check_config(cfg, world_size=1)
    gates.check_config(cfg, world_size=2)  # 4 divides 16
    message = refused("config", gates.check_config, cfg, world_size=3)  # 6 does not
    assert "= 16 sequences" in message and "3 ranks (torchrun --nproc_per_node) x train.grad_accum = 2" in message
    assert "so that 6 divides 16" in message
    odd = replace(cfg, rollout={"prompts_per_step": 3, "samples_per_prompt": 3}, train={"grad_accum": 1})
    gates.check_config(odd, world_size=3)  # 9 over 3 ranks x 1
    assert "so that 2 divides 9" in refused("config", gates.check_config, odd, world_size=2)
    updates = replace(cfg, train={"grad_accum": 2, "updates_per_batch": 2})
    gates.check_config(updates, world_size=2)  # 2 updates x 2 ranks x 2 micro-batches divide 16
    message = refused("config", gates.check_config, replace(cfg, train={"grad_accum": 2, "updates_per_batch": 3}), 1)
    assert "train.updates_per_batch = 3 updates" in message and "so that 6 divides 16" in message


def test_config_refuses_a_publish_cadence_beyond_the_allowed_policy_lag(cfg):
    gates.check_config(replace(cfg, checkpoint={"every": 50}), world_size=1)  # checkpoints are not the sync
    lagging = replace(cfg, publish={"every": 3})
    message = refused("config", gates.check_config, lagging, world_size=1)
    assert "publish.every = 3" in message and "up to 2 steps old" in message
    assert "rollout.max_policy_lag = 0" in message
    gates.check_config(replace(lagging, rollout={"max_policy_lag": 2}), world_size=1)
    refused("config", gates.check_config, replace(lagging, rollout={"max_policy_lag": 1}), world_size=1)


def test_config_refuses_requests_sent_further_ahead_than_the_allowed_policy_lag(cfg):
    ahead = replace(cfg, rollout={"ahead": 2, "max_policy_lag": 1})
    message = refused("config", gates.check_config, ahead, world_size=1)
    assert "rollout.ahead = 2" in message and "up to 2 steps old" in message
    gates.check_config(replace(cfg, rollout={"ahead": 2, "max_policy_lag": 2}), world_size=1)
    both = replace(cfg, rollout={"ahead": 1, "max_policy_lag": 2}, publish={"every": 3})
    assert "up to 3 steps old" in refused("config", gates.check_config, both, world_size=1)


def test_config_refuses_episodes_longer_than_the_spawned_workers_max_model_len(tmp_path, tiny_model):
    def episodes(tokens: int, worker_args: list[str], spawn: bool = True):
        return make_config(tmp_path / "run", tiny_model, env={"class": "m:E", "max_episode_tokens": tokens},
                           rollout={"spawn": spawn, "worker_args": worker_args})  # fmt: skip

    message = refused("config", gates.check_config, episodes(512, ["--max-model-len", "128"]), world_size=1)
    assert "env.max_episode_tokens = 512 is more than the spawned worker's --max-model-len 128" in message
    refused("config", gates.check_config, episodes(512, ["--no-compile", "--max-model-len=256"]), world_size=1)
    gates.check_config(episodes(512, ["--max-model-len", "512"]), world_size=1)
    gates.check_config(episodes(512, []), world_size=1)  # the model's own limit: the worker says at its start
    gates.check_config(episodes(512, ["--max-model-len", "128"], spawn=False), world_size=1)  # not ours to know


def test_config_refuses_an_armed_canary_with_too_few_held_out_problems(cfg):
    assert cfg.data.held_out == 10
    armed = replace(cfg, canary={"every": 2, "problems": 11})
    message = refused("config", gates.check_config, armed, world_size=1)
    assert "canary.problems = 11" in message and "data.held_out = 10" in message
    gates.check_config(replace(armed, canary={"problems": 10}), world_size=1)
    gates.check_config(replace(armed, canary={"every": 0}), world_size=1)  # not armed: not checked


# -- ceiling -------------------------------------------------------------------------------------


class NeverRight(Verifier):
    def verify(self, predicted, gold):
        return False


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from trainer_svc.learning.model import load_tokenizer

    return load_tokenizer(str(tiny_model))


def receipt_on_disk(run_dir: Path) -> dict:
    return json.loads((run_dir / gates.RECEIPT).read_text())


def test_ceiling_passes_the_arithmetic_task_with_the_default_reward(cfg, tokenizer, tmp_path):
    problems = arithmetic_problems(0, 9, "+-")
    with Verifier() as verifier:
        receipt = gates.ceiling_receipt(cfg, problems, tokenizer, verifier)
    assert receipt["n"] == 200 and receipt["perfect_rate"] == 1.0 and receipt["wrong_rate"] == 0.0
    assert receipt["failures"] == []
    gates.check_ceiling(receipt, tmp_path)
    assert receipt_on_disk(tmp_path)["perfect_rate"] == 1.0 and receipt_on_disk(tmp_path)["n"] == 200


def test_ceiling_refuses_golds_the_verifier_cannot_read(cfg, tokenizer, tmp_path):
    words = [Problem(f"w{i}", f"{i}+{i}=", word) for i, word in enumerate(["zero", "two", "four", "six"])]
    with Verifier() as verifier:
        receipt = gates.ceiling_receipt(cfg, words, tokenizer, verifier)
    assert receipt["perfect_rate"] == 0.0
    message = refused("ceiling", gates.check_ceiling, receipt, tmp_path)
    assert (
        "a perfect policy would score 0%" in message
        and "verifier" in message
        and str(tmp_path / gates.RECEIPT) in message
    )
    saved = receipt_on_disk(tmp_path)
    assert saved["perfect_rate"] == 0.0 and [f["gold"] for f in saved["failures"]] == ["zero", "two", "four", "six"]
    assert all(f["values"]["correct"] == 0.0 for f in saved["failures"])


def test_ceiling_refuses_a_verifier_that_never_agrees(cfg, tokenizer, tmp_path):
    receipt = gates.ceiling_receipt(cfg, arithmetic_problems(0, 3), tokenizer, NeverRight())
    assert receipt["perfect_rate"] == 0.0 and receipt["n"] == 16
    message = refused("ceiling", gates.check_ceiling, receipt, tmp_path)
    assert "'gold': '0'" in message  # examples of the failures
    saved = receipt_on_disk(tmp_path)
    assert len(saved["failures"]) == 5 and saved["failures"][0]["prompt"] == "0+0="


def test_ceiling_refuses_a_verifier_that_accepts_wrong_answers(cfg, tokenizer, tmp_path):
    class AlwaysRight(Verifier):
        def verify(self, predicted, gold):
            return True

    receipt = gates.ceiling_receipt(cfg, arithmetic_problems(0, 3), tokenizer, AlwaysRight())
    assert receipt["perfect_rate"] == 1.0 and receipt["wrong_rate"] == 1.0
    assert "a wrong one 100%" in refused("ceiling", gates.check_ceiling, receipt, tmp_path)


def test_ceiling_refuses_a_format_reward_that_rejects_the_gold_format(cfg, tokenizer, tmp_path):
    # The format reward wants an integer (rewards.ANSWER_FORMAT); these golds are decimals.
    decimals = [Problem(f"d{i}", f"{i}/2=", f"{i}.5") for i in range(1, 9, 2)]
    with Verifier() as verifier:
        plain = gates.ceiling_receipt(cfg, decimals, tokenizer, verifier)
        shaped = gates.ceiling_receipt(replace(cfg, reward={"weights": [1.0, 0.5, 1.0]}), decimals, tokenizer, verifier)
    gates.check_ceiling(plain, tmp_path)  # the verifier reads decimals; without format shaping, fine
    assert plain["perfect_rate"] == 1.0 and plain["wrong_rate"] == 0.0
    assert shaped["perfect_rate"] == 0.0
    refused("ceiling", gates.check_ceiling, shaped, tmp_path)
    failures = receipt_on_disk(tmp_path)["failures"]
    assert failures and all(
        f["values"] == {"correct": 1.0, "format": -1.0, "overlong": 0.0} and f["reward"] == 0.5 for f in failures
    )


def test_ceiling_refuses_an_overlong_buffer_that_taxes_a_perfect_answer(cfg, tokenizer, tmp_path):
    # max_tokens 4; a buffer of 4 penalises any answer longer than 0 tokens
    taxed = replace(cfg, reward={"overlong_buffer": 4})
    with Verifier() as verifier:
        receipt = gates.ceiling_receipt(taxed, arithmetic_problems(0, 3), tokenizer, verifier)
    assert receipt["perfect_rate"] == 0.0
    refused("ceiling", gates.check_ceiling, receipt, tmp_path)


def test_ceiling_judges_through_the_built_ins_and_names_the_functions_it_cannot_judge(cfg, tokenizer, tmp_path):
    # A user's function has no known maximum: not judged; `correct` weighted 0 (logged only)
    # still tells a wrong answer from the gold.
    mixed = replace(cfg, reward={"functions": ["correct", "format", "my.mod:style"], "weights": [0.0, 0.0, 1.0]})
    with Verifier() as verifier:
        receipt = gates.ceiling_receipt(mixed, arithmetic_problems(0, 3), tokenizer, verifier)
        lax = gates.ceiling_receipt(mixed, arithmetic_problems(0, 3), tokenizer, AcceptsAll())
    assert (receipt["perfect_rate"], receipt["wrong_rate"], receipt["n"]) == (1.0, 0.0, 16)
    assert receipt["judged_by"] == ["correct", "format"] and receipt["not_judged"] == ["my.mod:style"]
    assert "a wrong one 100%" in refused("ceiling", gates.check_ceiling, lax, tmp_path)


class AcceptsAll(Verifier):
    def verify(self, predicted, gold):
        return True


@pytest.mark.parametrize(
    "functions, problems, why",
    [
        (
            ["format", "my.mod:style"],
            arithmetic_problems(0, 3),
            'reward.functions has no "correct": the gate judges perfect and wrong answers through it',
        ),
        (["my.mod:style"], [Problem("chat-1", "hi")], 'reward.functions has no "correct"'),
    ],
    ids=["no correct", "no correct and no gold"],
)
def test_ceiling_is_skipped_where_it_is_not_defined_and_the_receipt_says_why(
    cfg, tokenizer, tmp_path, caplog, functions, problems, why
):
    judged = replace(cfg, reward={"functions": functions, "weights": [1.0] * len(functions)})
    receipt = gates.ceiling_receipt(judged, problems, tokenizer, NeverRight())  # never asked
    gates.check_ceiling(receipt, tmp_path)  # no refusal
    saved = receipt_on_disk(tmp_path)
    assert saved["skipped"].startswith(why) and saved["n"] == 0 and saved["not_judged"] == ["my.mod:style"]
    assert "launch gate 'ceiling' skipped: " + saved["skipped"] in caplog.text


def test_ceiling_without_a_gold_to_write_from_is_skipped(cfg, tokenizer, tmp_path):
    receipt = gates.ceiling_receipt(cfg, [Problem("chat-1", "hi"), Problem("chat-2", "ho")], tokenizer, NeverRight())
    assert receipt["skipped"] == "no problem has a gold answer to write a perfect and a wrong completion from"
    gates.check_ceiling(receipt, tmp_path)


def test_ceiling_reads_decimal_golds_and_rejects_their_successor(cfg, tokenizer):
    decimals = [Problem("a", "?", "2.5"), Problem("b", "?", "-0.25"), Problem("c", "?", "1,000")]
    with Verifier(use_math_verify=False) as verifier:
        receipt = gates.ceiling_receipt(cfg, decimals, tokenizer, verifier)
    assert (receipt["perfect_rate"], receipt["wrong_rate"]) == (1.0, 0.0)


def test_ceiling_catches_a_lax_tolerance(cfg, tokenizer, tmp_path):
    problems = [Problem("a", "?", "2.5"), Problem("b", "?", "7")]
    with Verifier(use_math_verify=False, rel_tol=0.5) as lax:  # 3.5 passes for 2.5, 8 not for 7
        receipt = gates.ceiling_receipt(cfg, problems, tokenizer, lax)
    assert (receipt["perfect_rate"], receipt["wrong_rate"]) == (1.0, 0.5)
    assert "a wrong one 50%" in refused("ceiling", gates.check_ceiling, receipt, tmp_path)


# -- band ----------------------------------------------------------------------------------------


def write_band(path: Path, manifest: dict | None) -> str:
    path.write_text(json.dumps({"id": "add-1-2", "prompt": "1+2=", "gold": "3", "pass_rate": 0.5}) + "\n")
    if manifest is not None:
        Path(str(path) + ".manifest.json").write_text(json.dumps(manifest))
    return str(path)


def test_band_gate_is_silent_without_a_band_file(cfg):
    assert gates.check_band(cfg) is None


def test_band_gate_refuses_a_band_file_without_manifest(cfg, tmp_path):
    band = write_band(tmp_path / "band.jsonl", None)
    message = refused("band", gates.check_band, replace(cfg, data={"band_file": band}))
    assert f"{band}.manifest.json is missing" in message and "trainer-svc band" in message


def test_band_gate_refuses_a_manifest_of_another_model(cfg, tmp_path, tiny_model, warm_model):
    model = os.path.realpath(tiny_model)
    other = os.path.realpath(warm_model)
    band = write_band(tmp_path / "band.jsonl", {"model": other, "content_id": weights_content_id(other), "rows": 1})
    message = refused("band", gates.check_band, replace(cfg, data={"band_file": band}))
    assert f"banded on {other}" in message and f"starts from {model}" in message and "band again" in message


def test_band_gate_refuses_a_manifest_of_other_content_at_the_same_path(cfg, tmp_path, tiny_model):
    model = os.path.realpath(tiny_model)
    band = write_band(tmp_path / "band.jsonl", {"model": model, "content_id": "stat-0123456789abcdef", "rows": 1})
    message = refused("band", gates.check_band, replace(cfg, data={"band_file": band}))
    assert "content stat-0123456789abcdef" in message and f"content {weights_content_id(model)}" in message


def test_band_gate_accepts_the_manifest_of_this_model(cfg, tmp_path, tiny_model):
    model = os.path.realpath(tiny_model)
    split = {"seed": cfg.run.seed, "held_out": cfg.data.held_out}
    manifest = {"model": model, "content_id": weights_content_id(model), "rows": 1, "settings": split}
    band = write_band(tmp_path / "band.jsonl", manifest)
    assert gates.check_band(replace(cfg, data={"band_file": band})) == manifest
    # the model named through a symlink is the same model
    link = tmp_path / "model-link"
    link.symlink_to(tiny_model)
    assert gates.check_band(replace(cfg, data={"band_file": band}, model={"path": str(link)})) == manifest


def test_band_gate_refuses_a_band_made_with_another_split(cfg, tmp_path, tiny_model):
    # Another seed or held-out count splits the problems differently: the band's prompts could
    # include the problems this run's canary holds out.
    model = os.path.realpath(tiny_model)
    manifest = {
        "model": model,
        "content_id": weights_content_id(model),
        "rows": 1,
        "settings": {"seed": cfg.run.seed + 1, "held_out": cfg.data.held_out},
    }
    band = write_band(tmp_path / "band.jsonl", manifest)
    message = refused("band", gates.check_band, replace(cfg, data={"band_file": band}))
    assert "held-out" in message and f"run.seed {cfg.run.seed + 1}" in message


# -- topology ------------------------------------------------------------------------------------


def spawning(cfg):
    return replace(cfg, rollout={"spawn": True})


def test_topology_spawn_on_a_machine_without_gpus_uses_the_cpu(cfg, monkeypatch):
    monkeypatch.delenv("ROLLOUT_GPU", raising=False)
    assert gates.check_topology(spawning(cfg), world_size=1, cuda_devices=0) == {
        "train_ranks": 1,
        "rollout_device": "cpu",
    }
    monkeypatch.setenv("ROLLOUT_GPU", "7")  # nothing to place on a CPU machine
    assert gates.check_topology(spawning(cfg), world_size=2, cuda_devices=0)["rollout_device"] == "cpu"


def test_topology_spawn_refuses_when_every_gpu_trains(cfg, monkeypatch):
    monkeypatch.delenv("ROLLOUT_GPU", raising=False)
    message = refused("topology", gates.check_topology, spawning(cfg), world_size=2, cuda_devices=2)
    assert "cuda:0..1" in message and "2 GPUs are visible" in message and "free a GPU" in message
    assert gates.check_topology(spawning(cfg), world_size=2, cuda_devices=3) == {
        "train_ranks": 2,
        "rollout_device": "cuda:2",
    }


def test_topology_spawn_refuses_a_rollout_gpu_that_a_rank_uses(cfg, monkeypatch):
    monkeypatch.setenv("ROLLOUT_GPU", "1")
    message = refused("topology", gates.check_topology, spawning(cfg), world_size=2, cuda_devices=4)
    assert "ROLLOUT_GPU=1" in message and "[2, 3]" in message
    for bad in ("4", "cuda:3", "-1", ""):  # not visible, or not an index
        monkeypatch.setenv("ROLLOUT_GPU", bad)
        refused("topology", gates.check_topology, spawning(cfg), world_size=2, cuda_devices=4)
    monkeypatch.setenv("ROLLOUT_GPU", "3")
    assert gates.check_topology(spawning(cfg), world_size=2, cuda_devices=4) == {
        "train_ranks": 2,
        "rollout_device": "cuda:3",
    }


def worker(worker_id: str, device: str, host: str | None = None) -> WorkerStatus:
    now = time.time()
    return WorkerStatus(
        worker_id=worker_id,
        pid=4242,
        host=host or socket.gethostname(),
        device=device,
        engine="vllm 0",
        state="idle",
        lease_s=30.0,
        started_at=now,
        heartbeat_at=now,
    )


def test_topology_attach_refuses_a_worker_on_a_training_gpu_of_this_host(cfg):
    assert not cfg.rollout.spawn
    clash = [worker("w-gpu2", "cuda:2"), worker("w-gpu0", "cuda:0")]
    message = refused("topology", gates.check_topology, cfg, world_size=2, cuda_devices=4, live_workers=clash)
    assert "['w-gpu0']" in message and "w-gpu2" not in message
    fine = [
        worker("w-gpu2", "cuda:2"),
        worker("w-gpu3", "cuda:3"),
        worker("elsewhere", "cuda:0", host="another-host.invalid"),
    ]
    assert gates.check_topology(cfg, world_size=2, cuda_devices=4, live_workers=fine) == {
        "train_ranks": 2,
        "rollout_device": "workers on the spool",
    }
    # training on the CPU shares no GPU with anyone
    assert gates.check_topology(cfg, world_size=1, cuda_devices=0, live_workers=clash)["train_ranks"] == 1


def test_topology_attach_maps_training_ranks_through_cuda_visible_devices(cfg, monkeypatch):
    # The trainer's two ranks run on physical GPUs 2 and 3; a worker reports its physical GPU
    # (rollout_svc.cli._device: cuda:<its CUDA_VISIBLE_DEVICES>).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    refused(
        "topology", gates.check_topology, cfg, world_size=2, cuda_devices=2, live_workers=[worker("w-gpu2", "cuda:2")]
    )


def fake_rollout_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A rollout venv whose `rollout-svc` records the CUDA_VISIBLE_DEVICES it was started with."""
    venv, record = tmp_path / "fake-venv", tmp_path / "worker-env.txt"
    (venv / "bin").mkdir(parents=True)
    script = venv / "bin" / "rollout-svc"
    script.write_text(f'#!/bin/sh\nprintf "%s" "${{CUDA_VISIBLE_DEVICES-unset}}" > "{record}"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return venv, record


def spawned_worker_gpus(cfg, tmp_path, world_size: int = 2, cuda_devices: int = 4) -> str:
    from trainer_svc.rollout.client import RolloutService

    venv, record = fake_rollout_venv(tmp_path)
    service = RolloutService(
        replace(cfg, rollout={"spawn": True, "rollout_venv": str(venv)}),
        world_size=world_size,
        cuda_devices=cuda_devices,
    )
    try:
        assert service.worker.proc.wait(timeout=30) == 0
    finally:
        service.close()
    return record.read_text()


def test_topology_spawned_worker_gets_the_gpu_the_gate_approved(cfg, tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("ROLLOUT_GPU", "3")
    assert gates.check_topology(spawning(cfg), world_size=2, cuda_devices=4)["rollout_device"] == "cuda:3"
    assert spawned_worker_gpus(cfg, tmp_path) == "3"


@pytest.mark.parametrize(
    "visible, rollout_gpu, world, devices, physical",
    [
        (None, None, 2, 4, "2"),  # the gate's default GPU; the worker is given none and takes cuda:0, rank 0's
        ("1,0", "1", 1, 2, "0"),  # visible index 1 is physical GPU 0; the worker is sent to physical 1, rank 0's
    ],
    ids=["default-rollout-gpu", "remapped-visible-devices"],
)
def test_topology_spawned_worker_lands_on_the_approved_gpu(
    cfg, tmp_path, monkeypatch, visible, rollout_gpu, world, devices, physical
):
    for name, value in (("CUDA_VISIBLE_DEVICES", visible), ("ROLLOUT_GPU", rollout_gpu)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    approved = gates.check_topology(spawning(cfg), world_size=world, cuda_devices=devices)["rollout_device"]
    assert approved == f"cuda:{rollout_gpu or world}"
    assert spawned_worker_gpus(cfg, tmp_path, world, devices) == physical


def test_topology_colocate_shares_rank_0s_gpu_only_when_asked(cfg, monkeypatch):
    monkeypatch.delenv("ROLLOUT_GPU", raising=False)
    message = refused("topology", gates.check_topology, spawning(cfg), world_size=1, cuda_devices=1)
    assert "rollout.colocate = true" in message
    shared = replace(cfg, rollout={"spawn": True, "colocate": True})
    placed = gates.check_topology(shared, world_size=1, cuda_devices=1)
    assert placed == {"train_ranks": 1, "rollout_device": "cuda:0 (shared with rank 0: rollout.colocate)"}
    assert "has 2 ranks" in refused("topology", gates.check_topology, shared, world_size=2, cuda_devices=2)
    assert gates.check_topology(shared, world_size=1, cuda_devices=0)["rollout_device"] == "cpu"


@pytest.mark.parametrize("sleep_s", [0.0, 2.5], ids=["awake", "colocate_sleep_s"])
def test_colocated_worker_gets_rank_0s_gpu_its_memory_share_and_sleeps_only_when_asked(
    cfg, tmp_path, monkeypatch, sleep_s
):
    from trainer_svc.rollout.client import RolloutService

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    venv, record = tmp_path / "fake-venv", tmp_path / "worker-args.txt"
    (venv / "bin").mkdir(parents=True)
    script = venv / "bin" / "rollout-svc"
    script.write_text(f'#!/bin/sh\nprintf "%s " "$CUDA_VISIBLE_DEVICES" "$@" > "{record}"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    rollout = {"spawn": True, "colocate": True, "colocate_gpu_memory": 0.25, "rollout_venv": str(venv)}
    shared = replace(cfg, rollout={**rollout, "colocate_sleep_s": sleep_s})
    service = RolloutService(shared, world_size=1, cuda_devices=1)
    try:
        assert service.worker.proc.wait(timeout=30) == 0
    finally:
        service.close()
    gpu, *args = record.read_text().split()
    assert gpu == "5"
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.25"
    # Awake by default: it generates the next steps while the trainer trains (rollout.ahead).
    if sleep_s:
        assert float(args[args.index("--sleep-when-idle") + 1]) == sleep_s
    else:
        assert "--sleep-when-idle" not in args


# -- horizon -------------------------------------------------------------------------------------


def test_horizon_refuses_a_schedule_of_another_length(cfg):
    assert cfg.train.steps == 6
    gates.check_horizon(6, cfg, None)
    message = refused("horizon", gates.check_horizon, 5, cfg, None)
    assert "spans 5 steps, the run train.steps = 6" in message


def test_horizon_refuses_a_resume_with_other_steps(cfg):
    gates.check_horizon(6, cfg, 6)
    message = refused("horizon", gates.check_horizon, 6, cfg, 4)
    assert "started with train.steps = 4" in message and "resuming with 6" in message
    assert "Resume with the original value" in message


def refused_relaunch(warm_model, tmp_path) -> tuple[GateRefused, Path, str]:
    """A finished 2-step run relaunched with train.steps = 4: (the refusal, run_dir, metrics before)."""
    from local_sampler import TorchSampler

    from trainer_svc.run.loop import train

    first = make_config(tmp_path / "run", warm_model, train={"steps": 2})
    assert train(first, make_sampler=TorchSampler) == exit_codes.OK
    metrics = (first.run_dir / "metrics.jsonl").read_text()
    with pytest.raises(GateRefused) as info:
        train(make_config(tmp_path / "run", warm_model, train={"steps": 4}), make_sampler=TorchSampler)
    return info.value, first.run_dir, metrics


def test_horizon_gate_stops_a_relaunch_with_other_steps(warm_model, tmp_path):
    refusal, run_dir, metrics = refused_relaunch(warm_model, tmp_path)
    assert refusal.gate == "horizon" and refusal.exit_code == exit_codes.GATE_REFUSED
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]


def test_horizon_gate_tells_a_relaunch_to_resume_with_the_original_steps(warm_model, tmp_path):
    refusal, _, _ = refused_relaunch(warm_model, tmp_path)
    assert "started with train.steps = 2" in str(refusal) and "Resume with the original value" in str(refusal)


# -- end to end through the CLI ------------------------------------------------------------------


def write_config(tmp_path: Path, model: Path, **sections) -> Path:
    sections = {
        "run": {"dir": str(tmp_path / "run")},
        "model": {"path": str(model)},
        **sections,
    }
    sections["rollout"] = {"spawn": True, "rollout_venv": str(ROLLOUT_VENV), **sections.get("rollout", {})}
    path = tmp_path / "run.toml"
    path.write_bytes(msgspec.toml.encode(sections))
    return path


def assert_nothing_started(run_dir: Path) -> None:
    assert not (run_dir / "checkpoints").exists()
    assert not (run_dir / "rollout-worker.log").exists()
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "stage_result.json").exists()


@pytest.mark.skipif(not (ROLLOUT_VENV / "bin" / "rollout-svc").exists(), reason="needs the rollout venv")
def test_cli_train_with_an_indivisible_batch_exits_3(warm_model, tmp_path):
    path = write_config(
        tmp_path, warm_model, rollout={"prompts_per_step": 3, "samples_per_prompt": 3}, train={"grad_accum": 2}
    )
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == exit_codes.GATE_REFUSED, result.output
    assert "launch gate 'config' refused the run" in result.output
    assert "= 9 sequences" in result.output and "so that 2 divides 9" in result.output
    assert_nothing_started(tmp_path / "run")
    assert not (tmp_path / "run" / gates.RECEIPT).exists()  # the config gate runs first


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains `text`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue  # exited meanwhile
    return pids


@pytest.mark.skipif(not (ROLLOUT_VENV / "bin" / "rollout-svc").exists(), reason="needs the rollout venv")
def test_cli_train_refused_by_the_ceiling_stops_the_worker_it_started(warm_model, tmp_path):
    rows = tmp_path / "halves.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}/2=", "gold": f"{i}.5"}) + "\n" for i in range(1, 20, 2)))
    path = write_config(
        tmp_path,
        warm_model,
        data={"task": "file", "path": str(rows), "held_out": 2},
        reward={"functions": ["correct", "format", "overlong"], "weights": [1.0, 0.2, 1.0]},
        rollout={"prompts_per_step": 4, "samples_per_prompt": 4},
    )
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == exit_codes.GATE_REFUSED, result.output
    assert (
        "launch gate 'ceiling' refused the run" in result.output and "a perfect policy would score 0%" in result.output
    )
    assert receipt_on_disk(tmp_path / "run")["n"] == 10
    # The worker starts before the gates (its engine start overlaps them); the refusal stopped it.
    run_dir = tmp_path / "run"
    assert (run_dir / "rollout-worker.log").exists() and processes_naming(str(run_dir / "spool")) == []
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()
