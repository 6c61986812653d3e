"""A hostile request file in the spool never stops the trainer's housekeeping: pruning published
weights and choosing a weight slot, called as a run calls them, with a request of 100,000 `[`
(json.loads raises RecursionError), a FIFO, a symlink to /dev/zero and bytes that are not UTF-8
in requests/ and claimed/. A worker refuses each of those, so none of them names weights: the
prune and the slot choice go on, and a valid request still protects what it names."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from protocol.spool import Spool  # noqa: E402
from trainer_svc.weights.publish import prune_published, publish  # noqa: E402
from trainer_svc.weights.slots import SlotRing  # noqa: E402
from trainer_svc.weights.writer import as_stream  # noqa: E402

pytestmark = pytest.mark.timeout(120)

DEADLINE_S = 30.0


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"model.embed_tokens.weight": torch.randn(16, 8, generator=g), "model.norm.weight": torch.randn(8)}


def plant_hostile_requests(spool: Spool, which: str) -> None:
    (spool.requests / "deep.json").write_bytes(b"[" * 100_000)
    if which == "deep":
        return
    os.mkfifo(spool.requests / "fifo.json")
    os.symlink("/dev/zero", spool.requests / "zero.json")
    (spool.requests / "latin.json").write_bytes(b"\xff\xfe{")
    (spool.claimed / "deep2@gpu0.json").write_bytes(b'{"weights_dir": ' + b"[" * 100_000)


def request(weights_dir: Path, request_id: str) -> str:
    return json.dumps(
        {"request_id": request_id, "weights_dir": str(weights_dir), "prompts": ["1+1="], "n_samples_per_prompt": 1,
         "max_tokens": 2, "temperature": 0.0}
    )  # fmt: skip


def finishes(call):
    """call()'s value; a test failure if it raises out or is still running after DEADLINE_S."""
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(_run(call)), daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    if thread.is_alive():
        pytest.fail(f"blocked for {DEADLINE_S} s on a hostile request file")
    kind, value = outcome[0]
    if kind == "raised":
        raise AssertionError(f"a hostile request file made it raise {type(value).__name__}") from value
    return value


def _run(call):
    try:
        return "value", call()
    except BaseException as exc:  # RecursionError included: the run would have died of it
        return "raised", exc


@pytest.mark.parametrize("which", ["deep", "all"])
def test_pruning_goes_on_past_hostile_request_files(base, tmp_path, which):
    publish_dir = tmp_path / "pub"
    paths = {s: publish(s, weights(s), publish_dir=publish_dir, base_model=base).path for s in range(1, 5)}
    spool = Spool(tmp_path / "spool", create=True)
    plant_hostile_requests(spool, which)
    (spool.requests / "r2.json").write_text(request(paths[2], "r2"))  # a real request still protects
    removed = finishes(lambda: prune_published(publish_dir, keep_last=1, spool_dir=spool.root))
    assert removed == [paths[1], paths[3]]
    assert sorted(p.name for p in publish_dir.iterdir()) == ["step_00000002", "step_00000004"]


@pytest.mark.parametrize("which", ["deep", "all"])
def test_the_slot_choice_goes_on_past_hostile_request_files(base, tmp_path, which):
    spool = Spool(tmp_path / "spool", create=True)
    ring = SlotRing(tmp_path / "ring", 2, spool_dir=spool.root, wait_s=0.2)
    written = []
    for step in (1, 2):
        slot = ring.choose()
        written.append(ring.write(slot, step, f"run-step{step}", as_stream(weights(step)), None, base).path)
    plant_hostile_requests(spool, which)
    assert finishes(ring.choose) == written[0]  # the older slot, which nothing valid names
