"""The slot ring (slot_publish, protocol.weight_slots), from the trainer's side and from real reader
and writer processes: a slot is reused only after its readers let go, a reader never copies a
half-written slot, and a writer SIGKILLed mid-write leaves the previous slot readable.

Run as a script, this file is also the child process of the reader and kill tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

from protocol.spool import Spool  # noqa: E402
from protocol.weight_slots import (  # noqa: E402
    SLOT_DATA,
    SLOT_MANIFEST,
    combine_sums,
    leases,
    read_slot_manifest,
    reading,
    word_sum,
)
from trainer_svc.weights.slots import SlotRing  # noqa: E402
from trainer_svc.weights.writer import TensorSpec, TensorStream, as_stream  # noqa: E402


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "model.embed_tokens.weight": torch.randn(64, 33, generator=g),  # 2112 floats: a gap follows it
        "model.norm.weight": torch.randn(33, generator=g).to(torch.bfloat16),  # 66 bytes: not whole words
        "model.layers.0.mlp.up_proj.weight": torch.randn(40, 33, generator=g),
    }


def write(ring: SlotRing, step: int, base: Path) -> Path:
    slot = ring.choose()
    assert slot is not None, "no free slot"
    return ring.write(slot, step, f"run-step{step}", as_stream(weights(step)), None, base).path


def read_back(slot: Path) -> dict[str, torch.Tensor]:
    """The slot's tensors, as a reader outside the trainer reads them: the manifest, then the bytes."""
    manifest = read_slot_manifest(slot)
    data = (slot / SLOT_DATA).read_bytes()[: manifest.bytes]
    assert combine_sums([word_sum(data)]) == manifest.checksum
    out = {}
    for name, entry in manifest.tensors.items():
        raw = bytearray(data[entry.offset : entry.offset + entry.nbytes])
        out[name] = torch.frombuffer(raw, dtype=getattr(torch, entry.dtype)).view(entry.shape)
    return out


def test_a_slot_holds_the_tensors_bit_for_bit_with_a_checksum_of_its_bytes(base, tmp_path):
    ring = SlotRing(tmp_path / "ring", 2, spool_dir=None, wait_s=0)
    slot = write(ring, 7, base)
    manifest = read_slot_manifest(slot)
    assert (manifest.step, manifest.content_id) == (7, "run-step7")
    assert all(entry.offset % 256 == 0 for entry in manifest.tensors.values())
    got = read_back(slot)
    assert got.keys() == weights(7).keys()
    for name, tensor in weights(7).items():
        assert torch.equal(got[name], tensor), name
    assert (slot / "config.json").read_text() == '{"model_type": "llama"}\n'
    # Another write into the same file (the mapping kept) leaves no byte of the first.
    write(ring, 8, base)
    write(ring, 9, base)
    assert read_slot_manifest(slot).step == 9
    assert all(torch.equal(read_back(slot)[n], t) for n, t in weights(9).items())


def test_the_ring_never_rewrites_the_newest_slot(base, tmp_path):
    ring = SlotRing(tmp_path / "ring", 2, spool_dir=None, wait_s=0)
    first, second, third = write(ring, 1, base), write(ring, 2, base), write(ring, 3, base)
    assert first != second and third == first
    assert read_slot_manifest(second).step == 2


def test_a_slot_is_reused_only_after_its_reader_lets_go(base, tmp_path):
    ring = SlotRing(tmp_path / "ring", 2, spool_dir=None, wait_s=0.2)
    old = write(ring, 1, base)
    write(ring, 2, base)
    before = read_slot_manifest(old)
    with reading(old, "worker-a"):
        assert ring.choose() is None  # the newest is never taken, the other is read
        assert not (old / SLOT_MANIFEST).exists()  # retired: no new reader starts on it
        data = (old / SLOT_DATA).read_bytes()[: before.bytes]
        assert combine_sums([word_sum(data)]) == before.checksum  # the reader's bytes are untouched
    assert ring.choose() == old


def test_a_slot_a_pending_request_names_is_not_reused(base, tmp_path):
    spool = Spool(tmp_path / "spool", create=True)
    ring = SlotRing(tmp_path / "ring", 2, spool_dir=spool.root, wait_s=0.2)
    old = write(ring, 1, base)
    write(ring, 2, base)
    request = {"request_id": "r1", "weights_dir": str(old), "prompts": ["1+1="], "n_samples_per_prompt": 1}
    (spool.requests / "r1.json").write_text(json.dumps(request | {"max_tokens": 2, "temperature": 0.0}))
    assert ring.choose() is None
    assert read_slot_manifest(old).step == 1  # still whole: the request's content id still holds
    (spool.requests / "r1.json").unlink()
    assert ring.choose() == old


def test_a_dead_readers_lease_does_not_hold_the_ring(base, tmp_path):
    ring = SlotRing(tmp_path / "ring", 2, spool_dir=None, wait_s=2)
    old = write(ring, 1, base)
    write(ring, 2, base)
    reader = subprocess.run(
        [sys.executable, __file__, "lease-and-die", str(old)], capture_output=True, text=True, timeout=120
    )
    assert reader.returncode == -signal.SIGKILL, reader.stderr
    assert len(leases(old)) == 1  # left behind by the dead process
    assert ring.choose() == old
    assert leases(old) == []


def test_a_reader_never_sees_a_half_written_slot(base, tmp_path):
    """A reader process loops: lease, manifest, copy, checksum; the trainer rewrites the ring as
    fast as it can meanwhile. Every copy a reader made under a manifest sums to its checksum."""
    ring = SlotRing(tmp_path / "ring", 2, spool_dir=None, wait_s=30)
    write(ring, 1, base)
    report = tmp_path / "reads.json"
    reader = subprocess.Popen([sys.executable, __file__, "read-loop", str(ring.ring), str(report), "6"])
    try:
        step = 2
        while reader.poll() is None and step < 10_000:
            write(ring, step, base)
            step += 1
    finally:
        reader.wait(timeout=120)
    assert reader.returncode == 0
    reads = json.loads(report.read_text())
    assert reads["checked"] > 20, reads
    assert reads["torn"] == 0, reads
    assert len(reads["steps"]) > 2, reads  # it read while the ring turned


def test_a_writer_sigkilled_mid_write_leaves_the_previous_slot_readable(base, tmp_path):
    ring_path = tmp_path / "ring"
    ready = tmp_path / "writing"
    writer = subprocess.Popen([sys.executable, __file__, "write-slowly", str(ring_path), str(base), str(ready)])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert writer.poll() is None and time.monotonic() < deadline, "the writer never started its second write"
            time.sleep(0.05)
        time.sleep(0.3)  # well inside the second write, which takes seconds
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.wait(timeout=60)
    ring = SlotRing(ring_path, 2, spool_dir=None, wait_s=0)
    complete = ring.complete()
    assert [manifest.step for _, manifest in complete] == [1]
    assert all(torch.equal(read_back(complete[0][0])[n], t) for n, t in weights(1).items())
    # The slot the killed writer was filling is written next, never the previous one.
    assert write(ring, 3, base) != complete[0][0]


# --- child processes -------------------------------------------------------------------------


def _lease_and_die(slot: str) -> None:
    with reading(slot, "worker-dead"):
        os.kill(os.getpid(), signal.SIGKILL)


def _read_loop(ring: str, report: str, seconds: str) -> None:
    checked, torn, steps = 0, 0, set()
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline:
        for slot in sorted(Path(ring).iterdir()):
            with reading(slot, "worker-reader"):
                try:
                    manifest = read_slot_manifest(slot)
                except FileNotFoundError:
                    continue  # retired or being written: not readable, by design
                data = (slot / SLOT_DATA).read_bytes()[: manifest.bytes]
                checked += 1
                torn += combine_sums([word_sum(data)]) != manifest.checksum
                steps.add(manifest.step)
    Path(report).write_text(json.dumps({"checked": checked, "torn": torn, "steps": sorted(steps)}))


def _write_slowly(ring_path: str, base: str, ready: str) -> None:
    ring = SlotRing(Path(ring_path), 2, spool_dir=None, wait_s=0)
    write(ring, 1, Path(base))
    tensors = weights(2)
    specs = [TensorSpec(n, tuple(t.shape), t.dtype, t.device) for n, t in tensors.items()]

    def fetch(names):
        Path(ready).touch()
        for name in names:
            time.sleep(2.0)  # a slow gather: the kill lands between two tensors or inside one
            yield name, tensors[name]

    ring.write(ring.choose(), 2, "run-step2", TensorStream(specs, fetch), None, Path(base))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"lease-and-die": _lease_and_die, "read-loop": _read_loop, "write-slowly": _write_slowly}[command](*args)
