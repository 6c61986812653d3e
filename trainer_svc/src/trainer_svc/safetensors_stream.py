"""Safetensors files written as a stream: tensors go from their device to the file in chunks.

    header(tensors, dtype) -> bytes                 a file's header, for (name, shape) in file order
    ShardFile(path, buffers, checksums)             .write(bytes), .append(name, tensor, dtype), .finish()
    Buffers(chunk_bytes, pinned)                    the two staging buffers, kept for the process's life
    write_small(path, data) -> {"size", "crc32"}    a whole small file, synced
    file_crc32(path, chunk_bytes) -> int            a file's crc32, read back
    write_error(exc, path, what) -> OSError         a failed write, named

Guarantees:

- The bytes are those of `safetensors.torch.save_file`: `header` writes the 8-byte little-endian
  length, then the compact JSON header (`__metadata__` {"format": "pt"}, then per tensor dtype,
  shape, data_offsets) padded with spaces to a multiple of 8; the tensors follow back to back, each
  cast to the file's dtype, in the order they are appended.
- CUDA tensors are cast on the device, a chunk at a time, and copied into two pinned host buffers
  in turn: one buffer is written while the copies into the other are in flight, and a buffer is
  written only once its copies are complete (a CUDA event). CPU tensors of the file's dtype are
  written straight from their memory; other CPU tensors are cast through the same buffers. Small
  tensors share a chunk. The file's bytes do not depend on the chunk size.
- Size and crc32 are counted on the bytes as they are written (no extra read); the crc32 of a large
  chunk runs in one helper thread while the chunk is written, so a file's chunks are summed in
  order. Each written range is handed to the kernel's writeback at once (sync_file_range, where
  libc has it), so `finish`'s fsync waits only for the tail.
- A file is created exclusively (O_EXCL, no symlink followed). A failed write raises OSError with
  the errno kept, naming the file and what was being written (the header, the tensor); a full
  disk (ENOSPC, EFBIG, EDQUOT) says so and what to do. Removing the partial file is the caller's.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import math
import os
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from protocol.fsio import FILE_MODE, write_synced

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_FULL_DISK = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
_THREADED_CRC_MIN = 1 << 20  # below this a chunk's crc is cheaper than a hand-off to the helper thread


def header(tensors: Iterable[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> bytes:
    """The header of a file holding (name, shape) tensors of `dtype`, in this order."""
    entries: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        end = offset + math.prod(shape) * dtype.itemsize
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text


def write_small(path: Path, data: bytes) -> dict:
    """Write a whole file and fsync it; its manifest entry: size and crc32."""
    try:
        write_synced(path, data)
    except OSError as exc:
        raise write_error(exc, path, "the file") from exc
    return {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def file_crc32(path: Path, chunk_bytes: int) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(chunk_bytes):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_error(exc: OSError, path: Path, what: str) -> OSError:
    hint = (
        " The filesystem is full or the file too large: free space there or publish elsewhere."
        if exc.errno in _FULL_DISK
        else ""
    )
    return OSError(
        exc.errno,
        f"writing {what} into {path} failed: {exc.strerror}.{hint} The previous weights directory is untouched",
    )


class Buffers:
    """Two staging buffers of chunk_bytes, pinned when tensors come from a GPU. They are kept for
    the process's life: pinning, or first touching fresh pages, costs milliseconds per write."""

    _cache: dict[tuple[int, bool], list[torch.Tensor]] = {}

    def __init__(self, chunk_bytes: int, pinned: bool):
        self.chunk_bytes = chunk_bytes
        self.pinned = pinned

    def get(self) -> list[torch.Tensor]:
        key = (self.chunk_bytes, self.pinned)
        if key not in self._cache:
            for other in [k for k in self._cache if k[1] == self.pinned]:
                del self._cache[other]  # one size of each kind at a time
            self._cache[key] = [
                torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pinned) for _ in range(2)
            ]
        return self._cache[key]


class ShardFile:
    """One safetensors file being appended to: size and crc32 counted as the bytes go out."""

    def __init__(self, path: Path, buffers: Buffers, checksums: bool):
        self.path = path
        self.buffers = buffers
        self.checksums = checksums
        self.size = 0
        self.crc = 0
        self.tensor = ""  # the tensor being written, for error messages
        self._fill = 0  # bytes staged in the current buffer
        self._current = 0  # which of the two buffers is being filled
        self._pending: tuple[int, int, object] | None = None  # (buffer, bytes, CUDA event): staged, not written
        self._staged_cuda = False  # the current buffer has copies from a GPU in flight
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        except OSError as exc:
            raise write_error(exc, path, "a shard") from exc

    def append(self, name: str, tensor: torch.Tensor, target: torch.dtype) -> None:
        self.tensor = name
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0:
            return
        if flat.device.type == "cpu" and flat.dtype == target:
            self._flush_staged()  # the file's bytes stay in order
            data = memoryview(flat.view(torch.uint8).numpy())
            for start in range(0, len(data), self.buffers.chunk_bytes):
                self.write(data[start : start + self.buffers.chunk_bytes])
            return
        self._stage(flat, target)

    def _stage(self, flat: torch.Tensor, target: torch.dtype) -> None:
        """Cast and copy into the staging buffers, chunk by chunk; a full buffer is written while
        the other one fills (on CUDA the copies are asynchronous)."""
        itemsize = target.itemsize
        cuda = flat.device.type == "cuda"
        pos, count = 0, flat.numel()
        while pos < count:
            take = min((self.buffers.chunk_bytes - self._fill) // itemsize, count - pos)
            buffer = self.buffers.get()[self._current]
            dst = buffer[self._fill : self._fill + take * itemsize].view(target)
            src = flat[pos : pos + take]
            if cuda:
                # cast on the device (a chunk-sized temporary), then one DMA into pinned memory
                dst.copy_(src.to(target), non_blocking=True)
                self._staged_cuda = True
            else:
                dst.copy_(src)
            self._fill += take * itemsize
            pos += take
            if self._fill == self.buffers.chunk_bytes:
                self._rotate()

    def _rotate(self) -> None:
        event = None
        if self._staged_cuda:  # the copies into this buffer are asynchronous: write it once they are done
            event = torch.cuda.Event()
            event.record()
            self._staged_cuda = False
        self._write_pending()
        self._pending = (self._current, self._fill, event)
        self._current ^= 1
        self._fill = 0

    def _write_pending(self) -> None:
        if self._pending is None:
            return
        index, nbytes, event = self._pending
        if event is not None:
            event.synchronize()
        self.write(memoryview(self.buffers.get()[index][:nbytes].numpy()))
        self._pending = None

    def _flush_staged(self) -> None:
        if self._fill:
            self._rotate()
        self._write_pending()

    def write(self, data: memoryview, *, what: str | None = None) -> None:
        future = None
        if self.checksums:
            if len(data) >= _THREADED_CRC_MIN:
                future = _crc_thread().submit(zlib.crc32, data, self.crc)
            else:
                self.crc = zlib.crc32(data, self.crc)
        try:
            view = data
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            raise write_error(exc, self.path, what or f"tensor {self.tensor!r}") from exc
        finally:
            if future is not None:
                self.crc = future.result()
        _start_writeback(self.fd, self.size, len(data))
        self.size += len(data)

    def finish(self) -> dict:
        self._flush_staged()
        try:
            os.fsync(self.fd)
        except OSError as exc:
            raise write_error(exc, self.path, "the end of the file") from exc
        return {"size": self.size, "crc32": f"{self.crc:08x}" if self.checksums else None}

    def close(self) -> None:
        os.close(self.fd)


_crc_pool: ThreadPoolExecutor | None = None


def _crc_thread() -> ThreadPoolExecutor:
    # One thread, so a file's chunks are summed in order; zlib.crc32 releases the GIL on large buffers.
    global _crc_pool
    if _crc_pool is None:
        _crc_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="crc32")
    return _crc_pool


@functools.cache
def _sync_file_range():
    return getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing this range now (SYNC_FILE_RANGE_WRITE: no wait), so disk
    writes overlap with the next chunk instead of all waiting for the final fsync."""
    fn = _sync_file_range()
    if fn is not None:
        fn(ctypes.c_int(fd), ctypes.c_int64(offset), ctypes.c_int64(nbytes), ctypes.c_uint(2))
