"""Loading a weight slot (protocol.weight_slots) into the engine: the worker's side of the same-host
fast path.

In the engine's own process (vllm_extension.WeightProbe.load_slot) the slot's tensors.bin is mapped:
on a GPU kept mapped between loads and registered with cudaHostRegister once, so each later copy
runs at the bus's speed, then copied to the device in one copy; on a CPU mapped copy-on-write for
the load, its bytes used as they are. The checksum is taken where the bytes lie (a sum of their
64-bit words, never a read of each tensor back), and the tensors, views of those bytes, go to the
model's own weight loading. No safetensors file is read.

Guarantees:
- The lease is taken before the manifest is read again and held until the engine's load returns,
  so the trainer never rewrites the slot under the copy (protocol.weight_slots: the writer removes
  the manifest, then waits for leases). A manifest that changed or went between the inspection
  and the lease is `SlotChanged`: the caller loads again, as for a directory replaced under a load.
- A copy whose sum differs from the manifest's checksum is refused (SlotChecksumMismatch): nothing
  is loaded into the engine from it, and the request gets `weights_invalid` (`slot_corruption`
  says why), a permanent error: sent again, the same bytes fail again.
- Private: before the lease is taken and again before tensors.bin is mapped, the ring and the
  slot must be directories of this user that nobody else can write, and tensors.bin a regular
  file of this user with one link, opened without following a link (protocol.weight_slots); a
  slot that fails is `weights_invalid`, naming the path, and nothing of it is mapped.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import warnings
from collections.abc import Iterator

from protocol import pinned_memory
from protocol.messages import ErrorCode
from protocol.private_dirs import NotPrivate
from protocol.weight_slots import (
    SLOT_DATA,
    SlotError,
    SlotManifest,
    combine_sums,
    open_slot_data,
    read_slot_manifest,
    reading,
)

from .errors import RequestFailed

log = logging.getLogger(__name__)


class SlotChanged(RuntimeError):
    """The slot was retired or rewritten between its inspection and the reader's lease."""


class SlotChecksumMismatch(RuntimeError):
    """A slot's bytes do not sum to its manifest's checksum."""


@contextlib.contextmanager
def slot_lease(real: str, content_id: str, reader: str) -> Iterator[None]:
    """Hold a reader's lease on the slot `real` for the body, once its manifest still names
    `content_id` under the lease (SlotChanged otherwise). A slot that is not private is refused
    (weights_invalid) before any lease is taken."""
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(reading(real, reader))
        except NotPrivate as exc:
            raise RequestFailed(ErrorCode.WEIGHTS_INVALID, f"weight slot refused: {exc.strerror}") from None
        try:
            now = read_slot_manifest(real).content_id
        except (OSError, SlotError):
            now = None
        if now != content_id:
            raise SlotChanged(f"{real} holds {now or 'nothing complete'} now, not {content_id}")
        yield


class MappedSlot:
    """A slot's tensors.bin mapped shared into this process, as a uint8 tensor (`view`), pinned
    (`pin`, on a GPU; through protocol.pinned_memory) when the runtime takes it: a registration
    that fails leaves the copies unpinned, with a warning."""

    def __init__(self, directory: str, pin: bool, private: bool = False):
        """`private`: copy-on-write (MAP_PRIVATE), so a loader that writes into a tensor it was
        handed changes only this mapping, never the slot; map it for one load only."""
        import torch

        path = os.path.join(directory, SLOT_DATA)
        self.pin = None
        fd = open_slot_data(directory, os.O_RDONLY)  # the ring private, tensors.bin no link: NotPrivate else
        try:
            st = os.fstat(fd)
            self.identity = (st.st_ino, st.st_size)
            if private:
                self.mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            else:
                self.mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is read-only: it is, by design
            self.view = torch.frombuffer(self.mm, dtype=torch.uint8)
        if pin and torch.cuda.is_available():
            read_only = self._pin(pinned_memory.READ_ONLY)
            writable = None
            if not read_only.pinned and os.access(path, os.W_OK):
                # Where read-only registration is not supported (most hosts without ATS), a writable
                # mapping can be registered; it is only ever read here.
                del self.view
                self.mm.close()
                fd = open_slot_data(directory, os.O_RDWR)
                try:
                    self.mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
                self.view = torch.frombuffer(self.mm, dtype=torch.uint8)
                writable = self._pin(0)
            if not self.pinned:
                tried = "not tried: the file is not writable" if writable is None else None
                log.warning(
                    "%s could not be pinned (cudaHostRegister failed: read-only, %s; writable, %s): its copies to "
                    "the GPU run unpinned, slower (the error is cleared); the memlock limit (ulimit -l, systemd "
                    "LimitMEMLOCK) may be too low",
                    path,
                    pinned_memory.error_text(read_only.code),
                    tried or pinned_memory.error_text(writable.code),
                )

    def _pin(self, flags: int) -> pinned_memory.Pin:
        import torch

        self.pin = pinned_memory.Pin(torch.cuda.cudart(), self.mm, self.view.data_ptr(), self.view.numel(), flags)
        return self.pin

    @property
    def pinned(self) -> bool:
        return self.pin is not None and self.pin.pinned

    def still(self, directory: str) -> bool:
        """Whether the file mapped is still the slot's tensors.bin, of the same size."""
        try:
            st = os.lstat(os.path.join(directory, SLOT_DATA))
        except FileNotFoundError:
            return False
        return (st.st_ino, st.st_size) == self.identity

    def close(self) -> None:
        if self.pin is not None:
            self.pin.release()
        del self.view
        with contextlib.suppress(BufferError):
            self.mm.close()


def mapped(cache: dict, directory: str, pin: bool) -> MappedSlot:
    """The mapping of `directory`'s tensors.bin from `cache`, made again when the file changed."""
    known = cache.get(directory)
    if known is not None and known.still(directory):
        return known
    if known is not None:
        known.close()
    cache[directory] = MappedSlot(directory, pin)
    return cache[directory]


def copy_to_device(slot: MappedSlot, manifest: SlotManifest, device):
    """The slot's bytes as a uint8 tensor on `device`: one copy (from pinned memory on a GPU); on
    the CPU, a private mapping's bytes themselves (the model's loader copies them into its
    parameters: a copy before it would only cost a pass over the weights)."""
    import torch

    if manifest.bytes > slot.view.numel():
        raise SlotChecksumMismatch(f"the slot holds {slot.view.numel()} bytes, its manifest names {manifest.bytes}")
    if device.type == "cpu":
        return slot.view[: manifest.bytes]
    copy = torch.empty(manifest.bytes, dtype=torch.uint8, device=device)
    copy.copy_(slot.view[: manifest.bytes], non_blocking=slot.pinned)
    return copy


def checksum(data) -> str:
    """protocol.weight_slots' checksum of a uint8 tensor (a multiple of 8 bytes), summed where it
    lies (torch's int64 sum wraps modulo 2**64, as the definition does)."""
    import torch

    return combine_sums([int(data.view(torch.int64).sum())])


def check(data, manifest: SlotManifest, where: str) -> None:
    got = checksum(data)
    if got != manifest.checksum:
        raise SlotChecksumMismatch(
            f"{where}: the copy sums to {got}, the manifest says {manifest.checksum}; the slot was changed under "
            "its reader or written wrongly: publish the weights again"
        )


def slot_corruption(directory: str, manifest: SlotManifest) -> str | None:
    """Why the slot cannot be loaded as it stands (not private, or its bytes do not sum to its
    manifest's checksum), or None when it can: asked after a load failed, in the worker's own
    process, so that a corrupt slot becomes a permanent weights_invalid rather than an engine
    error sent again and again (the same bytes fail every time)."""
    try:
        slot = MappedSlot(directory, pin=False)
    except NotPrivate as exc:
        return f"weight slot refused: {exc.strerror}"
    except OSError:
        return None  # gone meanwhile: the caller's inspection says so
    try:
        if manifest.bytes > slot.view.numel():
            return f"{directory}: tensors.bin holds {slot.view.numel()} bytes, its manifest names {manifest.bytes}"
        try:
            check(slot.view[: manifest.bytes], manifest, directory)
        except SlotChecksumMismatch as exc:
            return str(exc)
        return None
    finally:
        slot.close()


def tensors(data, manifest: SlotManifest) -> Iterator[tuple[str, object]]:
    """(name, tensor) for every tensor of the slot, as views of `data` (its bytes on some device)."""
    import torch

    for name, entry in manifest.tensors.items():
        dtype = getattr(torch, entry.dtype)
        yield name, data[entry.offset : entry.offset + entry.nbytes].view(dtype).view(entry.shape)
