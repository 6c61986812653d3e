"""rollout_svc.weight_forms: each form of a weights directory resolved from one read of its manifest,
after the allowed-root check; a manifest this contract does not read gives the errors it gave
before (the directory judged as full weights); hostile entries refused before any read. (The engine
loading each form: tests/unit/test_vllm_engine.py.)"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.append(str(Path(__file__).resolve().parents[1]))  # delta_chain, shared with the e2e tier
from delta_chain import Chain, moved  # noqa: E402

import protocol.fsio  # noqa: E402
from protocol.messages import ErrorCode  # noqa: E402
from protocol.weight_slots import SLOT_DATA, SLOT_MANIFEST, SlotManifest, encode_slot_manifest, plan_layout  # noqa: E402
from protocol.weights_dir import MANIFEST, Adapter, Manifest, encode_manifest  # noqa: E402
from rollout_svc.errors import RequestFailed  # noqa: E402
from rollout_svc.weight_forms import AdapterWeights, DeltaWeights, FullWeights, SlotWeights, resolve  # noqa: E402
from rollout_svc.weights import WeightsPolicy  # noqa: E402

CONFIG = {"model_type": "llama", "vocab_size": 64}


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The files read through protocol.fsio.read_regular_file (every bounded read of a weights
    directory's small files: manifests, configs, tokenizers), by resolved path."""
    seen: list[str] = []
    real = protocol.fsio._open_regular
    monkeypatch.setattr(protocol.fsio, "_open_regular", lambda path: seen.append(os.path.realpath(path)) or real(path))
    return seen


def model(path: Path, manifest: Manifest | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    (path / "tokenizer.json").write_text("{}\n")
    save_file({"model.norm.weight": torch.ones(16)}, str(path / "model.safetensors"))
    if manifest is not None:
        (path / MANIFEST).write_bytes(encode_manifest(manifest))
    return path


def adapter(path: Path) -> Path:
    path.mkdir(parents=True)
    save_file({"lora_A.weight": torch.ones(4, 8)}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    base = Adapter(base_content_id="base-1", rank=4, alpha=8.0, target_modules=["q_proj"])
    (path / MANIFEST).write_bytes(encode_manifest(Manifest(step=1, content_id="adapter-1", adapter=base)))
    return path


def slot(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    layout, total = plan_layout([("model.norm.weight", "float32", [16])])
    (path / SLOT_DATA).write_bytes(bytes(total))
    manifest = SlotManifest(
        step=2, content_id="slot-2", dtype="float32", bytes=total, checksum="0" * 16, tensors=layout
    )
    (path / SLOT_MANIFEST).write_bytes(encode_slot_manifest(manifest))
    return path


def chain(tmp_path: Path) -> Chain:
    chain = Chain(model(tmp_path / "base"), tmp_path / "published", tmp_path / "full")
    tensors = chain.tensors
    for step in (1, 2):
        tensors = moved(tensors, 0.05, seed=step)
        chain.publish(step, tensors, full=step == 1)
    return chain


def test_each_form_is_resolved_from_one_read_of_its_manifest(tmp_path, reads):
    full = model(tmp_path / "full", Manifest(step=1, content_id="full-1"))
    published = chain(tmp_path / "chain")
    expected = [
        (full, FullWeights, "full-1"),
        (slot(tmp_path / "slot"), SlotWeights, "slot-2"),
        (published.paths[2], DeltaWeights, None),  # a delta publish
        (published.paths[1], DeltaWeights, None),  # the anchor beside it
        (adapter(tmp_path / "adapter"), AdapterWeights, "adapter-1"),
    ]
    for path, form_type, content_id in expected:
        reads.clear()
        form = resolve(WeightsPolicy([str(tmp_path)]), str(path))
        assert type(form) is form_type and form.path == str(path), path
        assert content_id is None or form.content_id == content_id
        own = reads.count(os.path.realpath(path / MANIFEST))
        # An anchor's is read a second time with its neighbours', by the listing that tells it is one.
        assert own == (2 if path == published.paths[1] else 1), (path, reads)
    assert isinstance(resolve(WeightsPolicy(), str(published.paths[2])).manifest.delta_base, str)


def test_full_weights_without_a_manifest_read_it_once_and_take_the_files_stats(tmp_path, reads):
    path = model(Path(os.path.realpath(tmp_path)) / "m")
    form = resolve(WeightsPolicy(), str(path))
    assert isinstance(form, FullWeights) and form.content_id.startswith("stat-")
    assert reads.count(str(path / MANIFEST)) == 1
    assert reads.count(str(path / "config.json")) == 2  # validated, then hashed into the id


@pytest.mark.parametrize("manifest", ['{"content_id": ""}', '{"content_id": 7}', "{}", "[]", "{broken", '"x"'])
def test_a_manifest_this_contract_does_not_read_gives_the_errors_of_full_weights(tmp_path, manifest):
    plain = model(tmp_path / "plain")
    stat_id = resolve(WeightsPolicy(), str(plain)).content_id
    (plain / MANIFEST).write_text(manifest)
    assert resolve(WeightsPolicy(), str(plain)).content_id == stat_id
    broken = adapter(tmp_path / "adapter")
    (broken / MANIFEST).write_text(manifest)  # an adapter whose manifest is unreadable: no form of its own
    with pytest.raises(RequestFailed) as refused:
        resolve(WeightsPolicy(), str(broken))
    assert refused.value.code == ErrorCode.WEIGHTS_INVALID
    assert refused.value.message == f"weights_dir {broken} has no config.json; save the model with save_pretrained"


def test_hostile_entries_are_refused_before_the_manifest_is_read(tmp_path, reads):
    root = tmp_path / "root"
    fifo = model(root / "fifo")
    os.mkfifo(fifo / MANIFEST)
    linked = model(root / "linked")
    outside = model(tmp_path / "outside", Manifest(step=1, content_id="elsewhere")) / MANIFEST
    os.symlink(outside, linked / MANIFEST)
    (root / "file").write_text("not a directory")
    policy = WeightsPolicy([str(root)])
    cases = [
        (fifo, ErrorCode.WEIGHTS_INVALID, "manifest.json is a FIFO, not a regular file"),
        (linked, ErrorCode.WEIGHTS_NOT_ALLOWED, f"manifest.json resolves to {outside}, outside the allowed roots"),
        (root / "file", ErrorCode.WEIGHTS_NOT_FOUND, "does not exist or is not a directory"),
        (tmp_path / "outside", ErrorCode.WEIGHTS_NOT_ALLOWED, "is outside the allowed roots"),
    ]
    for path, code, phrase in cases:
        with pytest.raises(RequestFailed) as refused:
            resolve(policy, str(path))
        assert refused.value.code == code and phrase in refused.value.message, refused.value.message
        assert refused.value.message.startswith(f"weights_dir {path}")
    assert reads == []  # nothing of any of them was read
