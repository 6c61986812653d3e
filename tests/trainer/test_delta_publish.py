"""delta_publish: publishes as sparse deltas against the previous one, full anchors, the choice by
size, the worker's rebuild bit for bit, and pruning that keeps the links a chain needs."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from protocol import weights_chain  # noqa: E402
from protocol.weights_dir import read_manifest  # noqa: E402
from rollout_svc.delta_load import DeltaLoader  # noqa: E402
from rollout_svc.errors import RequestFailed  # noqa: E402
from rollout_svc.weights import WeightsPolicy  # noqa: E402
from trainer_svc.delta_publish import DeltaPublisher, deltas_wanted  # noqa: E402
from trainer_svc.publish import prune_published  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[1]))
from manifest_check import verify  # noqa: E402


@pytest.fixture
def base(tmp_path) -> Path:
    path = tmp_path / "base"
    path.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64}
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text("{}\n")
    return path


def start_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=g),
        "model.norm.weight": torch.randn(32, generator=g),
    }


def step(weights: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """An update that moves about `fraction` of the elements (in float32; the publish casts)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in weights.items():
        moved = torch.rand(tensor.shape, generator=g) < fraction
        out[name] = tensor + moved * 0.05 * (1 + tensor.abs())
    return out


def rebuilt(loader: DeltaLoader, path: Path) -> dict[str, torch.Tensor]:
    """What the worker's loader makes of a published directory: its tensors, as bfloat16."""
    from safetensors.torch import load_file

    weights = loader.inspect(str(path))
    return load_file(os.path.join(weights.real_path, weights.shards[0]))


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def test_a_chain_of_deltas_rebuilds_every_publish_bit_for_bit(base, tmp_path):
    publisher = DeltaPublisher(anchor_every=4)
    loader = DeltaLoader(WeightsPolicy([str(tmp_path)]), cache_dir=tmp_path / "cache")
    weights = start_weights()
    kinds = []
    for n in range(1, 10):
        weights = step(weights, 0.03, seed=n)
        record = publisher.publish(n, weights, publish_dir=tmp_path / "pub", base_model=base, dtype=torch.bfloat16)
        kinds.append(publisher.last.kind)
        verify(record.path, checksums=True)  # manifest last, every file listed with its crc32c
        served = {name: t.to(torch.bfloat16) for name, t in weights.items()}  # what a full publish holds
        assert same_bits(rebuilt(loader, record.path), served), n
        assert loader.inspect(str(record.path)).content_id == record.content_id == read_manifest(record.path).content_id
        if publisher.last.kind == "delta":
            assert publisher.last.delta_bytes < publisher.last.full_bytes / 4
            assert 0.005 < publisher.last.changed_fraction < 0.06
    # The first publish is full (nothing held), then a full anchor every 4 publishes.
    assert kinds == ["full", "delta", "delta", "delta", "full", "delta", "delta", "delta", "full"]
    chain = weights_chain.versions(tmp_path / "pub")
    assert [v.delta_base is None for v in sorted(chain.values(), key=lambda v: v.step)] == [
        kind == "full" for kind in kinds
    ]


def test_a_worker_holding_nothing_starts_from_the_anchor_and_a_missing_link_falls_back_to_a_newer_one(base, tmp_path):
    publisher = DeltaPublisher(anchor_every=3)
    weights, paths, served = start_weights(), {}, {}
    for n in range(1, 6):  # full, delta, delta, full, delta
        weights = step(weights, 0.03, seed=n)
        paths[n] = publisher.publish(
            n, weights, publish_dir=tmp_path / "pub", base_model=base, dtype=torch.bfloat16
        ).path
        served[n] = {name: t.to(torch.bfloat16) for name, t in weights.items()}
    fresh = DeltaLoader(WeightsPolicy(), cache_dir=tmp_path / "fresh")
    assert same_bits(rebuilt(fresh, paths[3]), served[3])
    assert fresh.last.full == read_manifest(paths[1]).content_id and len(fresh.last.deltas) == 2
    # Step 2 goes: step 3 can no longer be rebuilt from the anchor, step 5 can (from step 4).
    holder = DeltaLoader(WeightsPolicy(), cache_dir=tmp_path / "holder")
    assert same_bits(rebuilt(holder, paths[2]), served[2])
    shutil.rmtree(paths[2])
    assert same_bits(rebuilt(holder, paths[3]), served[3])  # it holds step 2: the chain reaches it
    assert same_bits(rebuilt(holder, paths[5]), served[5])
    assert holder.last.full == read_manifest(paths[4]).content_id  # its copy is not on 5's chain: the anchor
    with pytest.raises(RequestFailed) as failed:
        rebuilt(DeltaLoader(WeightsPolicy(), cache_dir=tmp_path / "other"), paths[3])
    assert failed.value.code.value == "weights_not_found"
    assert read_manifest(paths[1]).content_id not in failed.value.message  # names the break, not the anchor
    assert "cannot be rebuilt" in failed.value.message and "step_00000002" in failed.value.message


def test_a_dense_update_is_published_whole(base, tmp_path):
    publisher = DeltaPublisher(anchor_every=100)
    weights = start_weights()
    publisher.publish(1, weights, publish_dir=tmp_path / "pub", base_model=base, dtype=torch.bfloat16)
    dense = step(weights, 0.9, seed=2)
    publisher.publish(2, dense, publish_dir=tmp_path / "pub", base_model=base, dtype=torch.bfloat16)
    assert publisher.last.kind == "full" and "of the full weights" in publisher.last.reason
    assert publisher.last.changed_fraction > 0.5
    publisher.publish(3, step(dense, 0.01, seed=3), publish_dir=tmp_path / "pub", base_model=base, dtype=torch.bfloat16)
    assert publisher.last.kind == "delta"  # against the dense step's full publish, the new anchor


def test_prune_keeps_the_links_of_every_chain_it_must_keep(base, tmp_path):
    publisher = DeltaPublisher(anchor_every=4)
    weights, paths, served = start_weights(), {}, {}
    for n in range(1, 8):  # 1 full, 2-4 deltas, 5 full, 6-7 deltas
        weights = step(weights, 0.03, seed=n)
        paths[n] = publisher.publish(
            n, weights, publish_dir=tmp_path / "pub", base_model=base, dtype=torch.bfloat16
        ).path
        served[n] = {name: t.to(torch.bfloat16) for name, t in weights.items()}
    spool = tmp_path / "spool"
    for state in ("tmp", "requests", "claimed", "results", "done", "bad", "workers"):
        (spool / state).mkdir(parents=True)
    request = {"request_id": "r1", "weights_dir": str(paths[3]), "prompts": ["1+1="], "max_tokens": 4}
    (spool / "claimed" / "r1@w.json").write_text(json.dumps(request))
    removed = prune_published(tmp_path / "pub", keep_last=1, spool_dir=spool)
    # step 7 (kept) needs 6 and its anchor 5; step 3 (claimed) needs 2 and its anchor 1
    assert removed == [paths[4]]
    for n in (1, 2, 3, 5, 6, 7):
        assert paths[n].is_dir()
    assert same_bits(rebuilt(DeltaLoader(WeightsPolicy(), cache_dir=tmp_path / "c"), paths[3]), served[3])
    (spool / "claimed" / "r1@w.json").unlink()
    assert prune_published(tmp_path / "pub", keep_last=1, spool_dir=spool) == [paths[1], paths[2], paths[3]]
    assert sorted(p.name for p in (tmp_path / "pub").iterdir()) == ["step_00000005", "step_00000006", "step_00000007"]


def test_auto_publishes_deltas_over_a_network_filesystem_only(tmp_path):
    on, why = deltas_wanted("auto", tmp_path / "not-yet" / "weights")
    assert not on and "local filesystem" in why
    assert deltas_wanted("on", tmp_path) == (True, "publish.delta = on")
    assert deltas_wanted("off", tmp_path) == (False, "publish.delta = off")


def test_an_anchor_beside_deltas_is_read_once_and_the_next_delta_applies_to_it(base, tmp_path):
    publisher = DeltaPublisher(anchor_every=2)
    weights, paths, served = start_weights(), {}, {}
    for n in range(1, 5):  # full, delta, full, delta
        weights = step(weights, 0.03, seed=n)
        paths[n] = publisher.publish(
            n, weights, publish_dir=tmp_path / "pub", base_model=base, dtype=torch.bfloat16
        ).path
        served[n] = {name: t.to(torch.bfloat16) for name, t in weights.items()}
    loader = DeltaLoader(WeightsPolicy(), cache_dir=tmp_path / "cache")
    assert same_bits(rebuilt(loader, paths[3]), served[3])  # the anchor of step 4's chain: held
    assert loader.held.content_id == read_manifest(paths[3]).content_id
    assert same_bits(rebuilt(loader, paths[4]), served[4])
    assert loader.last.full is None and loader.last.deltas == (read_manifest(paths[4]).content_id,)
    outside = tmp_path / "elsewhere" / "model"
    shutil.copytree(paths[3], outside)  # a full directory that is no step of a chain: loaded as it is
    assert loader.inspect(str(outside)).real_path == str(outside)


def test_tensors_already_in_the_serving_dtype_are_read_in_place_and_never_kept(base, tmp_path):
    """A model trained in bfloat16 on the host: its parameters are diffed where they are, not
    copied; the copy held must still be the publish's, not the parameters updated in place since."""
    publisher = DeltaPublisher(anchor_every=3)
    loader = DeltaLoader(WeightsPolicy(), cache_dir=tmp_path / "cache")
    parameters = {name: t.to(torch.bfloat16) for name, t in start_weights().items()}
    kinds = []
    for n in range(1, 8):
        g = torch.Generator().manual_seed(n)
        with torch.no_grad():
            for t in parameters.values():  # an optimizer step: in place
                t.add_((torch.rand(t.shape, generator=g) < 0.03) * 0.25)
        snapshot = {name: t.clone() for name, t in parameters.items()}
        record = publisher.publish(n, parameters, publish_dir=tmp_path / "pub", base_model=base)
        kinds.append(publisher.last.kind)
        assert all(held is not parameters[name] for name, held in publisher.held.items())
        assert same_bits(rebuilt(loader, record.path), snapshot), n
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
