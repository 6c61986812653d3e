"""Checkpoints on one CPU process: an atomic directory with weights, copied config and tokenizer
files, a manifest with a per-save content id, and the trainer state a resume restores."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from trainer_svc.distributed import Distributed
from trainer_svc.weights import checkpoint

torch.set_num_threads(1)

ROLLOUT_SVC = Path(__file__).parents[2] / ".venvs/rollout/bin/rollout-svc"
CPU = Distributed(0, 1, torch.device("cpu"))
STATE = {"step": 1, "stream": {"epoch": 0, "cursor": 16}, "scheduler": {"last_epoch": 1}}


@pytest.fixture(scope="session")
def base_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("checkpoint-base") / "tiny"
    subprocess.run([str(ROLLOUT_SVC), "tiny-model", str(path)], check=True, capture_output=True)
    return path


def load_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def trained(base_model):
    """The tiny model and its AdamW after one optimizer step (so the optimizer has state)."""
    torch.manual_seed(0)
    model = load_model(base_model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    ids = torch.randint(3, model.config.vocab_size, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def save(run_dir: Path, step: int, trained, base_model: Path, state: dict | None = None) -> checkpoint.Checkpoint:
    model, optimizer = trained
    return checkpoint.save(
        run_dir=run_dir,
        step=step,
        model=model,
        optimizer=optimizer,
        base_model=base_model,
        trainer_state=state or {**STATE, "step": step},
        dist_info=CPU,
    )


def test_save_writes_a_complete_checkpoint_atomically(tmp_path, trained, base_model):
    run_dir = tmp_path / "run"
    ck = save(run_dir, 1, trained, base_model)
    assert ck.path == run_dir / "checkpoints" / "step_00000001" == checkpoint.checkpoint_dir(run_dir, 1)
    assert ck.step == 1
    # nothing else in checkpoints/: the hidden staging directory was renamed, not left behind
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000001"]
    assert not list(run_dir.rglob("*.partial"))

    manifest = json.loads((ck.path / "manifest.json").read_text())
    assert manifest["step"] == 1
    assert manifest["content_id"] == ck.content_id and ck.content_id
    assert manifest["base_model"] == str(base_model)

    # config, generation config and tokenizer files are the base's, byte for byte
    copied = [p for p in base_model.iterdir() if not p.name.endswith(".safetensors")]
    assert {p.name for p in copied} >= {"config.json", "tokenizer.json", "tokenizer_config.json"}
    for source in copied:
        assert (ck.path / source.name).read_bytes() == source.read_bytes(), source.name
    assert list(ck.path.glob("*.safetensors"))
    assert not list(ck.path.glob("*.bin")) and not list(ck.path.glob("*.pt"))

    state_dir = ck.path / "trainer_state"
    assert sorted(p.name for p in state_dir.iterdir()) == ["optimizer.pt", "rng.safetensors", "state.json"]
    optimizer_state = torch.load(state_dir / "optimizer.pt", weights_only=True)
    assert set(optimizer_state) == {"state", "param_groups"} and optimizer_state["state"]
    from safetensors.torch import load_file

    assert torch.equal(load_file(state_dir / "rng.safetensors")["torch"], torch.get_rng_state())
    assert json.loads((state_dir / "state.json").read_text()) == STATE


def test_a_failed_save_leaves_neither_checkpoint_nor_partial(tmp_path, trained, base_model, monkeypatch):
    def broken(path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "_save_rng", broken)
    with pytest.raises(OSError, match="No space left"):
        save(tmp_path, 1, trained, base_model)
    assert list((tmp_path / "checkpoints").iterdir()) == []
    assert checkpoint.latest(tmp_path) is None


def test_saved_weights_load_back_with_transformers(tmp_path, trained, base_model):
    model, _ = trained
    ck = save(tmp_path, 1, trained, base_model)
    loaded = load_model(ck.path).state_dict()
    expected = model.state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    # the step changed the weights, so this is not the base model read back
    base = load_model(base_model).state_dict()
    assert any(not torch.equal(base[name], tensor) for name, tensor in expected.items())


def test_two_saves_of_one_step_get_different_content_ids(tmp_path, trained, base_model):
    first = save(tmp_path, 1, trained, base_model)
    second = save(tmp_path, 1, trained, base_model)
    assert first.path == second.path
    assert first.content_id != second.content_id
    assert json.loads((second.path / "manifest.json").read_text())["content_id"] == second.content_id
    assert checkpoint.latest(tmp_path).content_id == second.content_id


def test_latest_picks_the_newest_complete_checkpoint(tmp_path, trained, base_model):
    assert checkpoint.latest(tmp_path) is None  # no checkpoints/ yet
    saved = [save(tmp_path, step, trained, base_model) for step in (1, 2, 10)]
    root = tmp_path / "checkpoints"
    # a crash mid-save leaves a hidden staging directory, even one that already has a manifest
    partial = root / ".step_00000011.4242.partial"
    partial.mkdir()
    (partial / "manifest.json").write_text(json.dumps({"step": 11, "content_id": "half"}))
    # a directory with a step name but no manifest is not a checkpoint
    (root / "step_00000012").mkdir()
    newest = checkpoint.latest(tmp_path)
    assert newest == saved[-1]
    assert (newest.path.name, newest.step) == ("step_00000010", 10)  # 10 after 2: by number


def test_prune_keeps_the_last_k_and_pinned_and_removes_partials(tmp_path, trained, base_model):
    paths = {step: save(tmp_path, step, trained, base_model).path for step in range(1, 6)}
    checkpoint.pin(paths[2], "tripwire: reward collapsed")
    leftover = tmp_path / "checkpoints" / ".step_00000006.999.partial"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")

    removed = checkpoint.prune(tmp_path, keep_last=2)

    assert sorted(removed) == [paths[1], paths[3]]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000002",
        "step_00000004",
        "step_00000005",
    ]
    assert (paths[2] / "PINNED").read_text() == "tripwire: reward collapsed\n"
    assert checkpoint.latest(tmp_path).step == 5
    assert checkpoint.prune(tmp_path, keep_last=2) == []  # idempotent


def test_prune_keeps_everything_when_there_are_fewer_than_k(tmp_path, trained, base_model):
    paths = [save(tmp_path, step, trained, base_model).path for step in (1, 2)]
    assert checkpoint.prune(tmp_path, keep_last=3) == []
    assert all(p.is_dir() for p in paths)


def test_load_trainer_state_restores_the_rng(tmp_path, trained, base_model):
    ck = save(tmp_path, 7, trained, base_model)
    after_save = torch.rand(8)
    torch.rand(1000)  # the run goes on drawing
    assert not torch.equal(torch.rand(8), after_save)
    state = checkpoint.load_trainer_state(ck)
    assert torch.equal(torch.rand(8), after_save)
    assert state == {**STATE, "step": 7}


def test_load_optimizer_state_restores_adam_moments(tmp_path, trained, base_model):
    model, optimizer = trained
    ck = save(tmp_path, 1, trained, base_model)

    fresh_model = load_model(ck.path)
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    assert not fresh.state
    checkpoint.load_optimizer_state(fresh_model, fresh, ck.path / "trainer_state" / "optimizer.pt", CPU)

    original = optimizer.state_dict()["state"]
    restored = fresh.state_dict()["state"]
    assert set(restored) == set(original) and len(original) == len(list(model.parameters()))
    for index, moments in original.items():
        assert torch.equal(restored[index]["exp_avg"], moments["exp_avg"]), index
        assert torch.equal(restored[index]["exp_avg_sq"], moments["exp_avg_sq"]), index
        assert float(restored[index]["step"]) == float(moments["step"]) == 1.0
    # the restore did not move the weights it was given
    for name, tensor in load_model(ck.path).state_dict().items():
        assert torch.equal(fresh_model.state_dict()[name], tensor), name


def test_load_weights_reads_a_checkpoint_in_one_file_or_in_shards(tmp_path):
    from safetensors.torch import save_file

    from trainer_svc.weights.checkpoint import load_weights

    tensors = {"a.weight": torch.arange(6.0).view(2, 3), "b.weight": torch.ones(4), "c.bias": torch.zeros(2)}
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    whole.mkdir()
    sharded.mkdir()
    save_file(tensors, whole / "model.safetensors")
    save_file({"a.weight": tensors["a.weight"]}, sharded / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in ("b.weight", "c.bias")}, sharded / "model-00002-of-00002.safetensors")
    for directory in (whole, sharded):
        loaded = load_weights(directory)
        assert loaded.keys() == tensors.keys()
        for name, tensor in tensors.items():
            torch.testing.assert_close(loaded[name], tensor)
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        load_weights(tmp_path)
