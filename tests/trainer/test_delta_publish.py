"""delta_publish: publishes as sparse deltas against the previous one, full anchors, the choice by
size, every publish rebuilt bit for bit from its chain, and pruning that keeps the links a chain
needs. The rebuild here is protocol's (weights_chain, weight_delta), what the worker's loader
does (rollout_svc.delta_load, tested in tests/unit/test_delta_load.py; both together through
vLLM in tests/e2e/test_trainer_process.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from protocol import weight_delta, weights_chain  # noqa: E402
from protocol.weights_dir import read_manifest  # noqa: E402
from trainer_svc.weights.deltas import DeltaWriter  # noqa: E402
from trainer_svc.weights.publish import prune_published  # noqa: E402
from trainer_svc.weights.sync import deltas_wanted  # noqa: E402

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


def rebuilt(path: Path) -> dict[str, torch.Tensor]:
    """Published weights rebuilt from nothing: the newest anchor on the chain, then each delta."""
    from safetensors.torch import load_file

    found = weights_chain.versions(path.parent)
    plan = weight_delta.plan(read_manifest(path).content_id, weights_chain.links(found))
    anchor = found[plan.full].path
    tensors = {}
    for shard in sorted(anchor.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    held = {name: t.view(torch.int16).numpy().view("<u2") for name, t in tensors.items()}  # bfloat16's bits
    content_id = plan.full
    for link in plan.deltas:
        delta = weight_delta.decode((found[link].path / weights_chain.DELTA_FILE).read_bytes())
        weight_delta.apply_model(held, delta, held_id=content_id)
        content_id = delta.content_id
    return tensors


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def test_a_chain_of_deltas_rebuilds_every_publish_bit_for_bit(base, tmp_path):
    publisher = DeltaWriter(anchor_every=4)
    weights = start_weights()
    kinds = []
    for n in range(1, 10):
        weights = step(weights, 0.03, seed=n)
        record = publisher.publish(n, weights, publish_dir=tmp_path / "pub", base_model=base, dtype=torch.bfloat16)
        kinds.append(publisher.last.kind)
        verify(record.path, checksums=True)  # manifest last, every file listed with its crc32c
        served = {name: t.to(torch.bfloat16) for name, t in weights.items()}  # what a full publish holds
        assert same_bits(rebuilt(record.path), served), n
        assert record.content_id == read_manifest(record.path).content_id
        if publisher.last.kind == "delta":
            assert publisher.last.delta_bytes < publisher.last.full_bytes / 4
            assert 0.005 < publisher.last.changed_fraction < 0.06
    # The first publish is full (nothing held), then a full anchor every 4 publishes.
    assert kinds == ["full", "delta", "delta", "delta", "full", "delta", "delta", "delta", "full"]
    chain = weights_chain.versions(tmp_path / "pub")
    assert [v.delta_base is None for v in sorted(chain.values(), key=lambda v: v.step)] == [
        kind == "full" for kind in kinds
    ]


def test_a_dense_update_is_published_whole(base, tmp_path):
    publisher = DeltaWriter(anchor_every=100)
    weights = start_weights()
    publisher.publish(1, weights, publish_dir=tmp_path / "pub", base_model=base, dtype=torch.bfloat16)
    dense = step(weights, 0.9, seed=2)
    publisher.publish(2, dense, publish_dir=tmp_path / "pub", base_model=base, dtype=torch.bfloat16)
    assert publisher.last.kind == "full" and "of the full weights" in publisher.last.reason
    assert publisher.last.changed_fraction > 0.5
    publisher.publish(3, step(dense, 0.01, seed=3), publish_dir=tmp_path / "pub", base_model=base, dtype=torch.bfloat16)
    assert publisher.last.kind == "delta"  # against the dense step's full publish, the new anchor


def test_prune_keeps_the_links_of_every_chain_it_must_keep(base, tmp_path):
    publisher = DeltaWriter(anchor_every=4)
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
    assert same_bits(rebuilt(paths[3]), served[3])
    (spool / "claimed" / "r1@w.json").unlink()
    assert prune_published(tmp_path / "pub", keep_last=1, spool_dir=spool) == [paths[1], paths[2], paths[3]]
    assert sorted(p.name for p in (tmp_path / "pub").iterdir()) == ["step_00000005", "step_00000006", "step_00000007"]


def test_auto_publishes_deltas_over_a_network_filesystem_only(tmp_path):
    from netfs import bindfs_mount, require

    on, why = deltas_wanted("auto", tmp_path / "not-yet" / "weights")
    assert not on and "local filesystem" in why
    require("bindfs")
    (tmp_path / "export").mkdir()
    with bindfs_mount(tmp_path / "export", tmp_path / "mounted") as mounted:  # FUSE, as sshfs is
        on, why = deltas_wanted("auto", mounted / "run" / "weights")
        assert on and why.startswith(f"auto: {mounted} is on a network filesystem (fuse")
    assert deltas_wanted("on", tmp_path) == (True, "publish.delta = on")
    assert deltas_wanted("off", tmp_path) == (False, "publish.delta = off")


def test_tensors_already_in_the_serving_dtype_are_read_in_place_and_never_kept(base, tmp_path):
    """A model trained in bfloat16 on the host: its parameters are diffed where they are, not
    copied; the copy held must still be the publish's, not the parameters updated in place since."""
    publisher = DeltaWriter(anchor_every=3)
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
        assert same_bits(rebuilt(record.path), snapshot), n
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
