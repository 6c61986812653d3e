"""A worker's LoRA adapters (rollout_svc.adapters), without an engine: what is refused and why,
the copy the engine reads, one vLLM id per content id, and the copies' eviction."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from protocol.messages import ErrorCode
from protocol.weights_dir import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MANIFEST,
    Adapter,
    FileEntry,
    Manifest,
    encode_manifest,
)
from rollout_svc.adapters import Adapters
from rollout_svc.errors import RequestFailed
from rollout_svc.weight_forms import AdapterWeights, FullWeights, resolve
from rollout_svc.weights import WeightsPolicy


@pytest.fixture(autouse=True)
def own_tmp(tmp_path, monkeypatch):
    """The workers' copies go into the test's own temporary directory (tempfile.gettempdir)."""
    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))


def write_adapter(path: Path, content_id: str, rank: int = 4, base: str = "stat-base") -> Path:
    """An adapter directory as the trainer publishes it: PEFT's two files, the manifest last."""
    path.mkdir(parents=True)
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(rank, 8)}
    save_file(tensors, path / ADAPTER_WEIGHTS)
    (path / ADAPTER_CONFIG).write_text(json.dumps({"r": rank, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    files = {name: FileEntry(size=(path / name).stat().st_size) for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)}
    manifest = Manifest(
        step=1, content_id=content_id, base_model="/models/base", bytes=sum(f.size for f in files.values()),
        files=files, adapter=Adapter(base_content_id=base, rank=rank, alpha=8.0, target_modules=["q_proj"]),
    )  # fmt: skip
    (path / MANIFEST).write_bytes(encode_manifest(manifest))
    return path


def prepared(adapters: Adapters, path: Path, expected: str | None = None, policy: WeightsPolicy | None = None):
    """What the engine does for a request naming the adapter `path`: resolve it, then prepare it."""
    return adapters.prepare(resolve(policy or WeightsPolicy(), str(path)), expected)


def refusal(adapters: Adapters, path: Path, expected: str | None = None, policy=None) -> RequestFailed:
    with pytest.raises(RequestFailed) as caught:
        prepared(adapters, path, expected, policy)
    return caught.value


def test_only_a_manifest_naming_a_base_makes_an_adapter(tmp_path):
    adapter = write_adapter(tmp_path / "adapter", "run-step_00000001-aaaa0000")
    form = resolve(WeightsPolicy(), str(adapter))
    assert isinstance(form, AdapterWeights) and form.manifest.adapter.rank == 4
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, model / "model.safetensors")
    (model / MANIFEST).write_bytes(encode_manifest(Manifest(step=1, content_id="x")))
    assert isinstance(resolve(WeightsPolicy(), str(model)), FullWeights)  # full weights


def test_a_worker_without_lora_or_with_a_lower_rank_refuses_naming_the_option(tmp_path):
    adapter = write_adapter(tmp_path / "adapter", "c1", rank=16)
    off = refusal(Adapters(max_rank=0, keep=2), adapter)
    assert off.code == ErrorCode.ADAPTER_REFUSED and "--max-lora-rank 16" in off.message
    low = refusal(Adapters(max_rank=8, keep=2), adapter)
    assert low.code == ErrorCode.ADAPTER_REFUSED and "rank 16, above this worker's --max-lora-rank 8" in low.message


def test_a_replaced_directory_or_a_torn_copy_is_refused(tmp_path):
    adapters = Adapters(max_rank=8, keep=2)
    adapter = write_adapter(tmp_path / "adapter", "c1")
    stale = refusal(adapters, adapter, expected="c0")
    assert stale.code == ErrorCode.WEIGHTS_INVALID and "weights_content_id" in stale.message
    with open(adapter / ADAPTER_WEIGHTS, "ab") as f:
        f.write(b"more")  # not the file the manifest lists
    torn = refusal(adapters, adapter)
    assert torn.code == ErrorCode.WEIGHTS_INVALID and "its manifest says" in torn.message
    incomplete = write_adapter(tmp_path / "incomplete", "c2")
    os.remove(incomplete / ADAPTER_CONFIG)
    assert "without adapter_config.json" in refusal(adapters, incomplete).message


def test_a_file_outside_the_allowed_roots_is_refused(tmp_path):
    root = tmp_path / "root"
    adapter = write_adapter(root / "adapter", "c1")
    outside = tmp_path / "elsewhere.safetensors"
    os.rename(adapter / ADAPTER_WEIGHTS, outside)
    os.symlink(outside, adapter / ADAPTER_WEIGHTS)
    refused = refusal(Adapters(max_rank=8, keep=2), adapter, policy=WeightsPolicy([str(root)]))
    assert refused.code == ErrorCode.WEIGHTS_NOT_ALLOWED


def test_each_content_id_gets_one_copy_and_one_id_and_old_copies_go(tmp_path):
    adapters = Adapters(max_rank=8, keep=2)
    refs = []
    for i in range(3):
        path = write_adapter(tmp_path / f"step{i}", f"c{i}")
        refs.append(prepared(adapters, path, f"c{i}"))
        assert Path(refs[-1].path, ADAPTER_WEIGHTS).read_bytes() == (path / ADAPTER_WEIGHTS).read_bytes()
    assert len({ref.lora_id for ref in refs}) == 3
    again = prepared(adapters, tmp_path / "step2")
    assert again == refs[2]  # held: the same copy and id, nothing read again
    assert not Path(refs[0].path).exists() and Path(refs[1].path).exists()  # keep = 2
    # Republished under the same path with new content: a new copy under a new id.
    (tmp_path / "step2" / MANIFEST).unlink()
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        (tmp_path / "step2" / name).unlink()
    (tmp_path / "step2").rmdir()
    path = write_adapter(tmp_path / "step2", "c2-again")
    newer = prepared(adapters, path)
    assert newer.lora_id not in {ref.lora_id for ref in refs}
    root = Path(newer.path).parent
    adapters.close()
    assert not root.exists()


def test_the_engine_is_sized_for_the_next_rank_vllm_has_and_bad_limits_are_refused():
    from rollout_svc.engines.vllm import VllmEngine

    def spec(**options):
        return VllmEngine(policy=WeightsPolicy(), **options).spec

    assert (spec().lora_rank, spec(max_lora_rank=4).lora_rank, spec(max_lora_rank=20).lora_rank) == (0, 8, 32)
    with pytest.raises(ValueError, match="--max-lora-rank 1000 is outside 0..512"):
        spec(max_lora_rank=1000)
    with pytest.raises(ValueError, match="need 1 <= max-loras <= max-cpu-loras"):
        spec(max_lora_rank=8, max_loras=4, max_cpu_loras=2)


def test_the_copies_of_a_worker_that_died_go_with_the_next_workers_first_copy(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / "tmp" / f"rollout-adapters-{dead.stdout.strip()}-abc"
    left.mkdir()
    alive = tmp_path / "tmp" / f"rollout-adapters-{os.getppid()}-def"  # a live process's: kept
    alive.mkdir()
    adapters = Adapters(max_rank=8, keep=2)
    path = write_adapter(tmp_path / "adapter", "c1")
    ref = prepared(adapters, path)
    assert not left.exists() and alive.exists()
    assert Path(ref.path).is_relative_to(tmp_path / "tmp")
    adapters.close()
