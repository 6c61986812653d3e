"""The four forms of the weight sync through one interface (weights.publishers.base.Publisher), as
weights.sync chooses and calls them: each publishes a step and returns what a request names,
finds the named weights again after a resume (discarding later ones), and gives back what it
holds at the end. Under FSDP2 (two CPU ranks over gloo) a directory, delta or adapter publish
crosses to rank 0 and back once (its outcome with the WeightsRef), a slot publish twice (to
choose the slot, then the outcome), and each writes what one process writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import msgspec
import pytest
import torch
from conftest import make_config
from transformers import AutoModelForCausalLM

from protocol.spool import Spool
from protocol.weight_slots import SLOT_DATA, SLOT_MANIFEST, read_slot_manifest, ring_dir
from protocol.weights_dir import read_manifest
from trainer_svc.distributed import Distributed
from trainer_svc.rollout_types import WeightsRef
from trainer_svc.weights.publishers.base import Publisher
from trainer_svc.weights.sync import WeightSync

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
FORMS = {
    "directory": {"publish": {"slots": "off", "delta": "off"}},
    "delta": {"publish": {"slots": "off", "delta": "on"}},
    "slot": {"publish": {"slots": "on", "delta": "off", "slots_wait_s": 0.0}},
    "adapter": {"lora": {"rank": 4, "alpha": 8.0}, "publish": {"slots": "off", "delta": "off"}},
}
BANNERS = {
    "directory": "weights directories in ",
    "delta": "weights directories in ",
    "slot": "shared-memory slots: 2 in ",
    "adapter": "LoRA adapter directories in ",
}


def config(tmp_path: Path, model: Path, form: str, **extra):
    sections = {name: dict(values) for name, values in FORMS[form].items()}
    sections["publish"]["slots_dir"] = str(tmp_path / "shm")
    sections["train"] = {"steps": 100}  # no publish here is the last step's (which adds a directory to slots)
    for name, values in extra.items():
        sections[name] = {**sections.get(name, {}), **values}
    (tmp_path / "shm").mkdir(parents=True, exist_ok=True)
    cfg = make_config(tmp_path / "run", model, **sections)
    Spool(cfg.spool_dir, create=True)
    return cfg


def load(model_dir: Path, cfg):
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if cfg.lora.on:
        from trainer_svc.learning.lora import with_adapter

        model = with_adapter(model, cfg.lora)
    return model


def content_id(ref: WeightsRef) -> str:
    """The content id where the ref points, read as a worker reads it: a slot's manifest or a directory's."""
    if (Path(ref.dir) / SLOT_MANIFEST).exists():
        return read_slot_manifest(ref.dir).content_id
    return read_manifest(ref.dir).content_id


@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_publishes_resumes_and_closes_through_one_interface(tiny_model, tmp_path, form):
    cfg = config(tmp_path, tiny_model, form)
    single = Distributed(0, 1, torch.device("cpu"))
    model = load(tiny_model, cfg)
    sync = WeightSync(cfg, single)
    assert isinstance(sync.publisher, Publisher) and sync.publisher.form == form
    assert sync.describe().startswith(BANNERS[form]), sync.describe()

    refs = [sync.publish(model, step) for step in (1, 2, 3)]
    assert [ref.step for ref in refs] == [1, 2, 3]
    assert len({ref.content_id for ref in refs}) == 3
    assert [content_id(ref) for ref in refs[1:]] == [ref.content_id for ref in refs[1:]]  # what a worker finds
    if form == "delta":  # the first is the anchor, the next two deltas on it
        assert [read_manifest(ref.dir).delta_base for ref in refs] == [None, refs[0].content_id, refs[1].content_id]
    if form == "adapter":
        assert read_manifest(refs[2].dir).adapter is not None
    if form == "slot":
        assert refs[0].dir == refs[2].dir != refs[1].dir  # two slots, rewritten in turn
        assert not cfg.publish_dir.exists() or not any(cfg.publish_dir.iterdir())

    # a relaunch resumed at step 2, whose requests named step 2: found again, step 3 discarded
    relaunched = WeightSync(cfg, single)
    assert relaunched.resume(model, 2, asdict(refs[1]), checkpoint=None) == refs[1]
    if form == "slot":
        assert [read_slot_manifest(refs[1].dir).step] == [2]
        assert not (Path(refs[2].dir) / SLOT_MANIFEST).exists()  # step 3's slot retired
    else:
        assert sorted(p.name for p in cfg.publish_dir.iterdir()) == ["step_00000001", "step_00000002"]
    # the starting model before any publish, and a step the requests did not name: published anew
    assert relaunched.resume(model, 0) == WeightsRef(str(tiny_model))
    again = relaunched.resume(model, 2, None, checkpoint=None)
    assert again.step == 2

    relaunched.close(run_over=False)  # a stopped run keeps what its relaunch names
    assert ring_dir(cfg.publish.slots_dir, cfg.run_dir).exists() == (form == "slot")
    relaunched.close(run_over=True)
    assert not ring_dir(cfg.publish.slots_dir, cfg.run_dir).exists()


def test_a_slot_publish_falls_back_to_a_directory_when_no_slot_is_free(tiny_model, tmp_path):
    cfg = config(tmp_path, tiny_model, "slot")
    single = Distributed(0, 1, torch.device("cpu"))
    model = load(tiny_model, cfg)
    sync = WeightSync(cfg, single)
    first, second = sync.publish(model, 1), sync.publish(model, 2)
    spool = Spool(cfg.spool_dir)
    for ref, request_id in ((first, "r1"), (second, "r2")):  # requests name both slots
        request = {"request_id": request_id, "weights_dir": ref.dir, "prompts": ["1+1="], "n_samples_per_prompt": 1}
        (spool.requests / f"{request_id}.json").write_text(json.dumps({**request, "max_tokens": 1, "temperature": 0}))
    third = sync.publish(model, 3)
    assert Path(third.dir) == cfg.publish_dir / "step_00000003" and read_manifest(third.dir).step == 3


ROUND_TRIPS = {"directory": 1, "delta": 1, "adapter": 1, "slot": 2}  # per publish, under FSDP2


@pytest.mark.parametrize("form", list(ROUND_TRIPS))
def test_a_publish_crosses_to_rank0_and_back_once_under_fsdp(tiny_model, tmp_path, form):
    cfg = config(tmp_path, tiny_model, form)
    config_file = tmp_path / "cfg.json"
    config_file.write_bytes(msgspec.json.encode(cfg))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # both ranks on the CPU, over gloo
    run = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc_per_node=2", __file__, str(config_file), str(tiny_model)],
        capture_output=True,
        text=True,
        timeout=360,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    outcome = {o["rank"]: o for o in (json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json")))}
    assert sorted(outcome) == [0, 1]
    assert outcome[0]["refs"] == outcome[1]["refs"]  # every rank names the same weights
    # the object broadcasts of each publish (the tensors' gathers aside): the slot's choice, then
    # rank 0's outcome with the WeightsRef
    assert outcome[0]["broadcasts"] == outcome[1]["broadcasts"] == [ROUND_TRIPS[form]] * 2
    two = [WeightsRef(**ref) for ref in outcome[0]["refs"]]
    assert [content_id(ref) for ref in two] == [ref.content_id for ref in two]
    if form == "delta":  # the second publish is a delta on the first
        assert read_manifest(two[1].dir).delta_base == two[0].content_id
    # what the two ranks wrote equals what one process writes of the same model
    single_cfg = config(tmp_path / "single", tiny_model, form)
    single = WeightSync(single_cfg, Distributed(0, 1, torch.device("cpu")))
    alone = single.publish(load(tiny_model, single_cfg), 1)
    if form == "slot":
        assert read_slot_manifest(two[0].dir).checksum == read_slot_manifest(alone.dir).checksum
        assert (Path(two[0].dir) / SLOT_DATA).read_bytes() == (Path(alone.dir) / SLOT_DATA).read_bytes()
    else:
        ours, theirs = read_manifest(two[0].dir).files, read_manifest(alone.dir).files
        assert {name: entry.crc32c for name, entry in ours.items()} == {n: e.crc32c for n, e in theirs.items()}


def _child(config_file: str, model_dir: str) -> None:
    import torch.distributed as dist

    from trainer_svc.config import Config
    from trainer_svc.distributed import init_distributed
    from trainer_svc.learning.model import shard

    torch.set_num_threads(1)
    cfg = msgspec.json.decode(Path(config_file).read_bytes(), type=Config)
    dist_info = init_distributed()
    model = load(Path(model_dir), cfg)
    shard(model)
    sync = WeightSync(cfg, dist_info)
    calls = []
    real = dist.broadcast_object_list
    dist.broadcast_object_list = lambda *a, **k: (calls.append(1), real(*a, **k))[1]  # the round trips to rank 0
    refs, broadcasts = [], []
    for step in (1, 2):
        calls.clear()
        refs.append(asdict(sync.publish(model, step)))
        broadcasts.append(len(calls))
    # a file per rank: two ranks printing at once can share one line of the common stdout
    outcome = {"rank": dist_info.rank, "refs": refs, "broadcasts": broadcasts}
    (Path(config_file).parent / f"rank{dist_info.rank}.json").write_text(json.dumps(outcome))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads may abort interpreter finalization (see test_weights_writer)


if __name__ == "__main__":
    _child(*sys.argv[1:])
