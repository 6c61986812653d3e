"""protocol.weight_slots: the slot manifest's checks, the layout, the checksum's definition, and
leases judged by the spool's liveness rules."""

from __future__ import annotations

import json
import os
import socket
import time

import msgspec
import numpy as np
import pytest

from protocol.messages import WorkerStatus
from protocol.spool import Spool
from protocol.weight_slots import (
    ALIGNMENT,
    LeaseJudge,
    SlotError,
    SlotManifest,
    combine_sums,
    decode_slot_manifest,
    encode_slot_manifest,
    leases,
    plan_layout,
    read_slot_manifest,
    word_sum,
)


def manifest(**changes) -> SlotManifest:
    layout, total = plan_layout([("a", "float32", [3, 5]), ("b", "bfloat16", [7])])
    fields = dict(step=3, content_id="run-step_00000003-1a2b3c4d", dtype="float32", bytes=total,
                  checksum="0" * 16, tensors=layout) | changes  # fmt: skip
    return SlotManifest(**fields)


def test_the_layout_aligns_every_tensor_and_the_manifest_reads_back():
    layout, total = plan_layout([("a", "float32", [3, 5]), ("b", "bfloat16", [7]), ("c", "float32", [0])])
    assert [t.offset for t in layout.values()] == [0, ALIGNMENT, 2 * ALIGNMENT]
    assert [t.nbytes for t in layout.values()] == [60, 14, 0] and total == 2 * ALIGNMENT
    m = manifest()
    text = encode_slot_manifest(m)
    assert decode_slot_manifest(text, "slot.json") == m
    lines = text.decode().splitlines()  # a field a line, a tensor a line: readable with cat
    assert ' "step": 3,' in lines
    assert '  "b": {"dtype": "bfloat16", "shape": [7], "offset": 256, "nbytes": 14}' in lines


@pytest.mark.parametrize(
    "change, phrase",
    [
        ({"format": "weight-slot/9"}, "format"),
        ({"bytes": 100}, "lies past"),
        ({"tensors": {"a": {"dtype": "float32", "shape": [3], "offset": 8, "nbytes": 12}}}, "not aligned"),
        ({"tensors": {"a": {"dtype": "float32", "shape": [3], "offset": 0, "nbytes": 16}}}, "does not match"),
        ({"tensors": {"a": {"dtype": "int8", "shape": [3], "offset": 0, "nbytes": 3}}}, "dtype"),
        (
            {
                "tensors": {
                    "a": {"dtype": "float32", "shape": [100], "offset": 0, "nbytes": 400},
                    "b": {"dtype": "float32", "shape": [1], "offset": 256, "nbytes": 4},
                }
            },
            "overlap",
        ),
        ({"checksum": "xyz"}, "checksum"),
    ],
)
def test_a_manifest_that_breaks_the_contract_is_refused_naming_why(change, phrase):
    fields = msgspec.to_builtins(manifest()) | change
    with pytest.raises(SlotError, match=phrase):
        decode_slot_manifest(json.dumps(fields).encode(), "slot.json")


def test_a_slot_without_a_manifest_is_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_slot_manifest(tmp_path)


def test_the_checksum_is_the_sum_of_64_bit_words_modulo_2_to_the_64():
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**64, size=4096, dtype=np.uint64)  # their sum wraps many times
    data = words.astype("<u8").tobytes()
    assert word_sum(data) == sum(int(w) for w in words) % 2**64
    assert combine_sums([word_sum(data[:1024]), word_sum(data[1024:])]) == combine_sums([word_sum(data)])
    assert combine_sums([-1]) == "f" * 16  # an int64 sum's negative value counts modulo 2**64
    changed = bytearray(data)
    changed[5] ^= 1
    assert word_sum(bytes(changed)) != word_sum(data)


def test_torchs_int64_sum_wraps_as_the_definition_does():
    """Readers and the writer sum with torch (on their device): its int64 sum must wrap."""
    import torch

    data = np.random.default_rng(1).integers(0, 256, size=2**20, dtype=np.uint8).tobytes()
    on_torch = int(torch.frombuffer(bytearray(data), dtype=torch.int64).sum())
    assert combine_sums([on_torch]) == combine_sums([word_sum(data)])


def status(worker_id: str, lease_s: float = 3.0) -> WorkerStatus:
    return WorkerStatus(worker_id=worker_id, pid=os.getpid(), host=socket.gethostname(), device="cpu", engine="vllm",
                        state="idle", started_at=time.time(), heartbeat_at=time.time(), lease_s=lease_s)  # fmt: skip


def lease_from_another_host(slot, reader: str):
    """A lease as a reader on another host (or in another pid namespace) leaves it: its pid means
    nothing here, so the judge goes by its worker's heartbeat, or by the file's own age."""
    (slot / "readers").mkdir(mode=0o700, exist_ok=True)
    path = slot / "readers" / f"{reader}.4242.lease"
    path.write_text(json.dumps({"reader": reader, "pid": 4242, "host": "elsewhere", "taken_at": time.time()}))
    return path


def test_a_lease_holds_while_its_workers_heartbeat_beats_and_is_released_once_it_stands_still(tmp_path):
    now = [0.0]
    spool = Spool(tmp_path / "spool", create=True, clock=lambda: now[0])
    judge = LeaseJudge(spool)
    slot = tmp_path / "slot_0"
    slot.mkdir()
    spool.write_status(status("w1"))
    lease_from_another_host(slot, "w1")
    assert [lease.reader for lease in judge.held(slot)] == ["w1"]
    now[0] += 2.0  # within the lease
    assert judge.held(slot)
    now[0] += 10.0  # the heartbeat stood still past its lease, watched for more than half of it
    assert judge.held(slot) == []
    assert leases(slot) == []  # removed: `ls readers/` shows what holds the slot


def test_a_lease_without_a_status_is_judged_by_its_own_age(tmp_path):
    now = [0.0]
    judge = LeaseJudge(None, default_lease_s=5.0, clock=lambda: now[0])
    slot = tmp_path / "slot_0"
    slot.mkdir()
    lease_from_another_host(slot, "somebody")
    assert judge.held(slot)
    now[0] += 6.0
    assert judge.held(slot) == []
