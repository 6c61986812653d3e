"""Publishing into a ring of shared-memory slots: the weight sync where the trainer and its rollout
worker share a host (protocol.weight_slots defines a slot; this module writes them).

Per publish the tensors go from the trainer's device into the slot's mapping of tensors.bin (on a
GPU one device-to-host copy per tensor into memory pinned once with cudaHostRegister; on a CPU a
memcpy), with the sums of their 64-bit words taken on the device as they go. No file is written tensor by
tensor, nothing is fsynced: a slot lives in memory, and a reboot ends the run's host anyway.

Guarantees (protocol.weight_slots states the slot's; these are the writer's):
- Never the newest slot: the slot a writer takes is one without complete weights, or a complete
  one other than the newest, so a writer SIGKILLed mid-write leaves the newest weights readable.
- Never a slot in use: not one that a request in the spool's requests/ or claimed/ names (its
  weights must stay what the request's content id says), and not one a reader's lease holds (the
  manifest is removed first, then the leases are judged: LeaseJudge).
- Private: the ring is made by this user with mode 0700 and checked before every write (a
  directory of this user nobody else can write, tensors.bin a regular file of this user with one
  link, opened without following links); a ring that fails is refused (NotPrivate, naming the
  path and what to do) before a byte is written through it.
- Bounded: `choose` waits at most `wait_s` for a free slot and returns None after that, for the
  caller to publish a directory instead (publishers.slot does, saying so in the log).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from protocol import fsio, pinned_memory
from protocol.spool import Spool
from protocol.spool_names import NamedWeights, weights_named
from protocol.weight_slots import (
    ALIGNMENT,
    SLOT_DATA,
    SLOT_MANIFEST,
    LeaseJudge,
    SlotError,
    SlotManifest,
    check_slot_private,
    combine_sums,
    encode_slot_manifest,
    make_ring,
    open_slot_data,
    plan_layout,
    read_slot_manifest,
    slot_dir_name,
)
from protocol.weights_dir import COPIED_FILES

from ..config import Config
from .writer import TensorStream

log = logging.getLogger(__name__)

POLL_S = 0.01  # between looks for a free slot


@dataclass(frozen=True)
class SlotWritten:
    path: Path
    step: int
    content_id: str
    bytes: int
    seconds: float


class SlotRing:
    """Rank 0's writer of one ring. Keeps each slot's tensors.bin mapped (and pinned, on a GPU)
    for the process's life: a slot is mapped and registered once, written many times."""

    def __init__(self, ring: Path, count: int, *, spool_dir: Path | None, wait_s: float):
        if count < 2:
            raise ValueError(f"a ring needs at least 2 slots (the newest is never rewritten), not {count}")
        self.ring = Path(ring)
        self.count = count
        self.wait_s = wait_s
        # The spool whose requests may name the slots and whose heartbeats keep readers' leases
        # (None, or not a spool yet: leases are judged by their processes and ages alone).
        is_spool = spool_dir is not None and (Path(spool_dir) / "requests").is_dir()
        self.spool_dir = Path(spool_dir) if is_spool else None
        self.judge = LeaseJudge(Spool(spool_dir) if is_spool else None)
        self._maps: dict[Path, _Mapping] = {}
        make_ring(self.ring, count)  # private to this user, or refused (NotPrivate)

    @classmethod
    def for_run(cls, cfg: Config, ring: Path) -> SlotRing:
        return cls(ring, cfg.publish.slots_count, spool_dir=cfg.spool_dir, wait_s=cfg.publish.slots_wait_s)

    @property
    def slots(self) -> list[Path]:
        return [self.ring / slot_dir_name(index) for index in range(self.count)]

    def complete(self) -> list[tuple[Path, SlotManifest]]:
        """The slots holding complete weights, oldest write first."""
        found = []
        for slot in self.slots:
            with contextlib.suppress(OSError, SlotError):  # none, or not a regular file: no complete weights
                found.append((slot, read_slot_manifest(slot)))
        return sorted(found, key=lambda pair: (pair[1].created_at or 0.0, pair[1].step))

    def holds(self, path: str | Path) -> bool:
        """Whether `path` names one of this ring's slots."""
        return os.path.realpath(path) in {os.path.realpath(slot) for slot in self.slots}

    def resumed(self, path: str, content_id: str | None, kept: Path | None) -> SlotWritten | None:
        """After a resume: the slot `path` when it still holds `content_id`; else `kept` (a copy of
        that slot a checkpoint made) put back into it; else None."""
        for slot, manifest in self.complete():
            if manifest.content_id == content_id:
                return SlotWritten(slot, manifest.step, manifest.content_id, manifest.bytes, 0.0)
        if kept is None or not (kept / SLOT_MANIFEST).is_file():
            return None
        slot = self.choose(wanted=Path(path))
        if slot is None:
            raise TimeoutError(f"{path} is still read after {self.wait_s} s; the weights it held cannot be put back")
        written = self.copy_from(kept, slot)
        log.info("the weights of step %d were gone from %s: put back from %s", written.step, slot, kept)
        return written

    def choose(self, wanted: Path | None = None) -> Path | None:
        """A slot to write now: retired (manifest removed) and free of readers. `wanted`: that slot
        only (a restore into the slot the requests name). Waits up to wait_s; None after that."""
        deadline = time.monotonic() + self.wait_s
        while True:
            slot = self._free(wanted)
            if slot is not None:
                return slot
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)

    def _free(self, wanted: Path | None) -> Path | None:
        if wanted is not None:  # a restore: the requests that name it want what is put back
            _retire(wanted)
            return None if self.judge.held(wanted) else wanted
        complete = self.complete()
        held_complete = {slot for slot, _ in complete}
        incomplete = [slot for slot in self.slots if slot not in held_complete]
        named = self._named()
        for slot in incomplete + [slot for slot, _ in complete[:-1]]:  # never the newest
            if slot in held_complete:
                if named is None or named.names(slot):
                    continue  # a pending request names it (or the spool cannot say): its weights must stay
                _retire(slot)
            if not self.judge.held(slot):
                return slot
        return None

    def _named(self) -> NamedWeights | None:
        """What pending or claimed requests name; None when that cannot be known."""
        if self.spool_dir is None:
            return NamedWeights(frozenset(), ())
        return weights_named(self.spool_dir)

    def write(
        self,
        slot: Path,
        step: int,
        content_id: str,
        tensors: TensorStream,
        dtype: torch.dtype | None,
        base_model: Path,
    ) -> SlotWritten:
        """Write `tensors` (in `dtype`; None: each its own) into `slot`, which `choose` returned,
        and its manifest last."""
        started = time.monotonic()
        check_slot_private(slot)  # before anything is removed or written in it
        _retire(slot)  # choose did; a restore or a caller that skipped it must not leave the old manifest
        _copy_model_files(base_model, slot)
        target = {spec.name: dtype or spec.dtype for spec in tensors.specs}
        layout, total = plan_layout(
            (spec.name, str(target[spec.name]).removeprefix("torch."), spec.shape) for spec in tensors.specs
        )
        cuda = any(spec.device.type == "cuda" for spec in tensors.specs)
        mapping = self._mapping(slot, max(total, ALIGNMENT), pin=cuda)
        sums = []
        for name, tensor in tensors.fetch(list(layout)):
            entry = layout[name]
            data = tensor.detach().to(target[name]).contiguous().reshape(-1).view(torch.uint8)
            sums.append(_word_sum(data))
            if data.device.type == "cpu":  # a plain memcpy: torch's copy_ waits on its thread pool per tensor
                np.copyto(mapping.array[entry.offset : entry.offset + entry.nbytes], data.numpy())
            else:
                mapping.view[entry.offset : entry.offset + entry.nbytes].copy_(data, non_blocking=mapping.pinned)
            gap_end = min(-(-(entry.offset + entry.nbytes) // ALIGNMENT) * ALIGNMENT, mapping.size)
            if gap_end > entry.offset + entry.nbytes:
                mapping.view[entry.offset + entry.nbytes : gap_end].zero_()
            del data, tensor  # under FSDP a gathered tensor is freed before the next is gathered
        if cuda:
            torch.cuda.synchronize()
        checksum = combine_sums(torch.stack([s.to(sums[0].device) for s in sums]).tolist() if sums else [])
        manifest = SlotManifest(
            step=step,
            content_id=content_id,
            dtype=str(dtype or next(iter(target.values()), torch.float32)).removeprefix("torch."),
            bytes=total,
            checksum=checksum,
            tensors=layout,
            base_model=str(base_model),
            write_seconds=round(time.monotonic() - started, 6),
            created_at=time.time(),
        )
        fsio.replace_atomic(slot / SLOT_MANIFEST, encode_slot_manifest(manifest), durable=False)
        return SlotWritten(slot, step, content_id, total, time.monotonic() - started)

    def copy_from(self, kept: Path, slot: Path) -> SlotWritten:
        """Put a kept copy of a slot (a checkpoint's `rollout_weights/`) into `slot`, content id
        included, so requests naming it are served as before."""
        started = time.monotonic()
        manifest = read_slot_manifest(kept)
        check_slot_private(slot)
        _retire(slot)
        _copy_model_files(kept, slot)
        mapping = self._mapping(slot, max(manifest.bytes, ALIGNMENT), pin=False)
        with open(kept / SLOT_DATA, "rb") as f:
            f.readinto(memoryview(mapping.mm)[: manifest.bytes])
        fsio.replace_atomic(slot / SLOT_MANIFEST, encode_slot_manifest(manifest), durable=False)
        return SlotWritten(slot, manifest.step, manifest.content_id, manifest.bytes, time.monotonic() - started)

    def discard_newer_than(self, step: int) -> list[Path]:
        """Retire the slots holding weights of steps after `step` (a resume will not take them)."""
        doomed = [slot for slot, manifest in self.complete() if manifest.step > step]
        for slot in doomed:
            _retire(slot)
        return doomed

    def in_use(self) -> list[Path]:
        """The slots a reader holds or a pending or claimed request names (all of them when the
        spool cannot say)."""
        named = self._named()
        return [s for s in self.slots if named is None or named.names(s) or self.judge.held(s)]

    def remove(self) -> None:
        """Remove the whole ring (its memory is the host's): at the end of a run."""
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()
        shutil.rmtree(self.ring, ignore_errors=True)

    def _mapping(self, slot: Path, size: int, *, pin: bool) -> _Mapping:
        """tensors.bin of `slot`, `size` bytes, mapped (kept from the last write when the file is
        the same file of the same size)."""
        fd = open_slot_data(slot, os.O_RDWR, create=True)  # never through a link, never another user's file
        try:
            st = os.fstat(fd)
            known = self._maps.get(slot)
            if known is not None and (known.inode, known.size) == (st.st_ino, size) and st.st_size == size:
                return known
            if known is not None:
                known.close()
                del self._maps[slot]
            if st.st_size != size:
                os.ftruncate(fd, size)  # no reader maps it now: the slot is retired and free of leases
            mapping = _Mapping(fd, size, st.st_ino, pin)
        finally:
            os.close(fd)
        self._maps[slot] = mapping
        return mapping


class _Mapping:
    """A slot's tensors.bin mapped shared, as a uint8 tensor; pinned (cudaHostRegister, through
    protocol.pinned_memory) when asked and CUDA is there. A registration that fails leaves the
    copies unpinned, with a warning."""

    def __init__(self, fd: int, size: int, inode: int, pin: bool):
        self.size, self.inode = size, inode
        self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)  # the same bytes, for copies from CPU tensors
        self.pin = None
        if pin and torch.cuda.is_available():
            self.pin = pinned_memory.Pin(torch.cuda.cudart(), self.mm, self.view.data_ptr(), size)
            if not self.pin.pinned:
                log.warning(
                    "cudaHostRegister of a %d-byte slot failed (%s): its copies run unpinned, slower (the "
                    "error is cleared). Is the slot on a tmpfs (/dev/shm)? The kernel may refuse to pin a writable "
                    "file mapping on a disk filesystem; else the memlock limit (ulimit -l) may be too low",
                    size,
                    pinned_memory.error_text(self.pin.code),
                )

    @property
    def pinned(self) -> bool:
        return self.pin is not None and self.pin.pinned

    def close(self) -> None:
        if self.pin is not None:
            self.pin.release()
        del self.view, self.array
        with contextlib.suppress(BufferError):  # a view still exported: the mapping goes with the process
            self.mm.close()


def _word_sum(data: torch.Tensor) -> torch.Tensor:
    """The checksum's partial sum of a tensor's bytes (protocol.weight_slots.word_sum), on its
    device: zero-padded to whole 64-bit words, summed as int64 (wrapping modulo 2**64)."""
    remainder = data.numel() % 8
    if remainder:
        data = torch.cat([data, torch.zeros(8 - remainder, dtype=torch.uint8, device=data.device)])
    return data.view(torch.int64).sum()


def _retire(slot: Path) -> None:
    """Remove the slot's manifest: from now on no reader starts on it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(slot / SLOT_MANIFEST)


def _copy_model_files(source: Path, slot: Path) -> None:
    """Config and tokenizer files beside the tensors (a new engine is built from them); rewritten
    only when they differ, so an unchanged one keeps its inode and mtime."""
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source} has no config.json: name the base model directory to copy it from")
    for name in COPIED_FILES:
        if not (source / name).is_file():
            continue
        data = (source / name).read_bytes()
        with contextlib.suppress(OSError, ValueError):  # none, larger, or not a regular file: replaced
            if fsio.read_regular_file(slot / name, len(data)) == data:
                continue
        fsio.replace_atomic(slot / name, data, durable=False)  # a rename: replaces a link, never writes through it
