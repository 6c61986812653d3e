"""rollout_svc.delta_load: a worker's rebuild of delta publishes, bit for bit, from the copy it holds
or the newest anchor; a chain broken before any anchor is a clear error; an anchor beside deltas
is read once. (Through vLLM: tests/e2e/test_vllm_worker.py; with the trainer's writer:
tests/e2e/test_trainer_process.py.)"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.append(str(Path(__file__).resolve().parents[1]))  # delta_chain, shared with the e2e tier
from delta_chain import Chain, manifest_of, moved  # noqa: E402

from protocol.messages import ErrorCode  # noqa: E402
from rollout_svc.delta_load import DeltaLoader  # noqa: E402
from rollout_svc.errors import RequestFailed  # noqa: E402
from rollout_svc.weight_forms import DeltaWeights, resolve  # noqa: E402
from rollout_svc.weights import Weights, WeightsPolicy  # noqa: E402


@pytest.fixture
def model(tmp_path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64}))
    (path / "tokenizer.json").write_text("{}\n")
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(64, 16, generator=g),
            "model.norm.weight": torch.randn(16, generator=g),
        },
        str(path / "model.safetensors"),
    )
    return path


def chain_of(model: Path, root: Path, anchors: set[int], steps: int) -> Chain:
    chain = Chain(model, root / "published", root / "full")
    tensors = chain.tensors
    for step in range(1, steps + 1):
        tensors = moved(tensors, 0.05, seed=step)
        chain.publish(step, tensors, full=step in anchors)
    return chain


def loaded(loader: DeltaLoader, path: Path) -> Weights:
    """What an engine loads for `path`: a delta publish (or anchor) through the loader."""
    form = resolve(loader.policy, str(path))
    return loader.weights(form) if isinstance(form, DeltaWeights) else form.weights


def served(loader: DeltaLoader, path: Path) -> dict[str, torch.Tensor]:
    weights = loaded(loader, path)
    assert weights.path == str(path) and weights.content_id == manifest_of(path)["content_id"]
    return load_file(str(Path(weights.real_path) / weights.shards[0]))


def full(chain: Chain, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(chain.full_paths[step] / "model.safetensors"))


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


def test_each_publish_of_a_chain_is_rebuilt_bit_for_bit(model, tmp_path):
    chain = chain_of(model, tmp_path, anchors={1, 4}, steps=6)
    loader = DeltaLoader(WeightsPolicy([str(tmp_path)]), cache_dir=tmp_path / "cache")
    for step in range(1, 7):
        assert same_bits(served(loader, chain.paths[step]), full(chain, step)), step
    # from the anchor at first, then from the copy held: one delta per step
    assert loader.last.full is None and len(loader.last.deltas) == 1


def test_a_worker_holding_nothing_starts_from_the_anchor_and_one_holding_another_version_too(model, tmp_path):
    chain = chain_of(model, tmp_path, anchors={1, 4}, steps=5)
    fresh = DeltaLoader(WeightsPolicy(), cache_dir=tmp_path / "fresh")
    assert same_bits(served(fresh, chain.paths[3]), full(chain, 3))
    assert fresh.last.full == manifest_of(chain.paths[1])["content_id"] and len(fresh.last.deltas) == 2
    # It holds step 3, which step 5's chain (5 -> 4, an anchor) does not reach: the anchor.
    assert same_bits(served(fresh, chain.paths[5]), full(chain, 5))
    assert fresh.last.full == manifest_of(chain.paths[4])["content_id"] and len(fresh.last.deltas) == 1


def test_a_missing_link_is_skipped_by_the_copy_held_and_otherwise_a_clear_error(model, tmp_path):
    chain = chain_of(model, tmp_path, anchors={1}, steps=4)
    holder = DeltaLoader(WeightsPolicy(), cache_dir=tmp_path / "holder")
    assert same_bits(served(holder, chain.paths[2]), full(chain, 2))
    shutil.rmtree(chain.paths[1])  # the anchor and the first link go (pruned, lost)
    shutil.rmtree(chain.paths[2])
    assert same_bits(served(holder, chain.paths[4]), full(chain, 4))  # 4 -> 3 -> 2, held
    with pytest.raises(RequestFailed) as failed:
        served(DeltaLoader(WeightsPolicy(), cache_dir=tmp_path / "other"), chain.paths[4])
    assert failed.value.code == ErrorCode.WEIGHTS_NOT_FOUND
    message = failed.value.message
    assert message.startswith(f"weights_dir {chain.paths[4]} is a delta publish that cannot be rebuilt")
    assert manifest_of(chain.paths[3])["delta_base"] in message  # the version the chain breaks at
    assert "holds no delta chain" in message


def test_an_anchor_beside_deltas_is_held_and_a_full_directory_elsewhere_is_loaded_as_it_is(model, tmp_path):
    chain = chain_of(model, tmp_path, anchors={1, 3}, steps=4)
    loader = DeltaLoader(WeightsPolicy(), cache_dir=tmp_path / "cache")
    weights = loaded(loader, chain.paths[3])
    assert weights.real_path != str(chain.paths[3]) and loader.held.content_id == weights.content_id
    assert same_bits(served(loader, chain.paths[4]), full(chain, 4))
    assert loader.last.full is None  # the anchor was not read again
    assert loaded(loader, chain.full_paths[4]).real_path == str(chain.full_paths[4])


def test_links_outside_the_allowed_roots_are_refused(model, tmp_path):
    chain = chain_of(model, tmp_path / "runs", anchors={1}, steps=2)
    (tmp_path / "inside").mkdir()
    (tmp_path / "inside" / "published").symlink_to(chain.publish_dir)
    loader = DeltaLoader(WeightsPolicy([str(tmp_path / "inside")]), cache_dir=tmp_path / "cache")
    with pytest.raises(RequestFailed) as failed:
        loaded(loader, tmp_path / "inside" / "published" / chain.paths[2].name)
    assert failed.value.code == ErrorCode.WEIGHTS_NOT_ALLOWED


def test_the_cache_of_a_worker_that_died_is_removed_by_the_next_one(model, tmp_path):
    import subprocess

    from rollout_svc import delta_load

    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names a process that is gone
    probe = delta_load._default_cache()
    root = probe.parent  # where a loader's cache goes on this machine
    probe.rmdir()
    stale = root / f"rollout-deltas-{dead.pid}-x-"
    live = root / f"rollout-deltas-{os.getppid()}-y-"  # the process that started this one: alive
    for path in (stale, live):
        (path / "weights").mkdir(parents=True)
    try:
        chain = chain_of(model, tmp_path, anchors={1}, steps=2)
        loader = DeltaLoader(WeightsPolicy())  # its own cache, made at its first rebuild
        assert same_bits(served(loader, chain.paths[2]), full(chain, 2))
        assert not stale.exists() and live.exists()
        assert loader.cache_dir.name.startswith(f"rollout-deltas-{os.getpid()}-")
        own = loader.cache_dir
        loader.close()
        assert not own.exists()
    finally:
        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)
