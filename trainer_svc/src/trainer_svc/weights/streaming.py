"""Safetensors files written as a stream: tensors go from their device to the file in chunks.

Guarantees:
- The bytes are those of `safetensors.torch.save_file`: `header` writes the 8-byte little-endian
  length, then the compact JSON header (`__metadata__` {"format": "pt"}, then per tensor dtype,
  shape, data_offsets) padded with spaces to a multiple of 8; the tensors follow back to back, each
  cast to the file's dtype, in the order they are appended.
- CUDA tensors are cast on the device, a chunk at a time, and copied into pinned host buffers
  taken from a pool; full buffers are written by several threads at once, each to its own offset
  (pwrite), while the next buffers fill, and a buffer is written only once its copies are complete
  (a CUDA event) and given back to the pool only once its write and checksum are done. Files of
  one write share the pool, so several can be filled side by side (the kernel serialises buffered
  writes into one file, not into several). CPU tensors of the file's dtype are written straight
  from their memory. A file's bytes do not depend on the chunk size, the threads or the other files.
- Size and crc32c are counted on the bytes as they are written (no extra read); the crc32c runs on
  one helper thread, chunk after chunk in file order. Each written range is handed to the
  kernel's writeback at once (sync_file_range, where libc has it), so `finish`'s fsync waits only
  for the tail. After a failed write no job of the pool touches a file or a buffer any more when
  the error is raised.
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
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import crc32c
import torch

from protocol.fsio import FILE_MODE, write_synced
from protocol.weights_dir import FileEntry

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_FULL_DISK = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


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


def write_small(path: Path, data: bytes) -> FileEntry:
    """Write a whole file and fsync it; its manifest entry: size and crc32c."""
    try:
        write_synced(path, data)
    except OSError as exc:
        raise write_error(exc, path, "the file") from exc
    return FileEntry(size=len(data), crc32c=f"{crc32c.crc32c(data):08x}")


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
    """`count` staging buffers of chunk_bytes, pinned when tensors come from a GPU. They are kept
    for the process's life: pinning, or first touching fresh pages, costs milliseconds per write."""

    _cache: dict[tuple[int, bool], list[torch.Tensor]] = {}

    def __init__(self, chunk_bytes: int, pinned: bool, count: int):
        self.chunk_bytes = chunk_bytes
        self.pinned = pinned
        self.count = count

    def get(self) -> list[torch.Tensor]:
        key = (self.chunk_bytes, self.pinned)
        have = self._cache.get(key, [])
        if len(have) < self.count:
            for other in [k for k in self._cache if k[1] == self.pinned and k != key]:
                del self._cache[other]  # one size of each kind at a time
            have = have + [
                torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pinned)
                for _ in range(self.count - len(have))
            ]
            self._cache[key] = have
        return have[: self.count]


class BufferPool:
    """The staging buffers of one write, lent to its files: a file takes a free buffer to fill,
    hands it over with the jobs that write and checksum it, and the buffer is free again once
    those are done. The pool needs a buffer per file being filled plus one per writer thread."""

    def __init__(self, buffers: Buffers):
        self.chunk_bytes = buffers.chunk_bytes
        self.buffers = buffers.get()
        self._free = list(range(len(self.buffers)))
        self._busy: dict[int, list[Future]] = {}  # buffer -> its write and checksum, in flight, oldest first

    @staticmethod
    def size_for(files: int) -> int:
        return files + writer_threads()

    def take(self) -> int:
        """A free buffer; waits for the oldest one in flight when none is free."""
        if not self._free:
            index = next(iter(self._busy))
            jobs = self._busy.pop(index)
            self._free.append(index)
            for future in jobs:
                self.result(future)
        return self._free.pop()

    def give_back(self, index: int, jobs: list[Future]) -> None:
        """`index` is free once `jobs` are done (none: at once)."""
        if jobs:
            self._busy[index] = jobs
        else:
            self._free.append(index)

    def result(self, future: Future):
        """A job's result; if it failed, every job of the pool is waited for before the error is
        raised, so none still writes into a file or reads a buffer."""
        try:
            return future.result()
        except BaseException:
            self.drain()
            raise

    def drain(self) -> None:
        for index, jobs in list(self._busy.items()):
            for future in jobs:
                future.exception()  # waits
            del self._busy[index]
            self._free.append(index)


class ShardFile:
    """One safetensors file being appended to: size and crc32c counted as the bytes go out.

    Every write goes to its own offset (os.pwrite), so chunks are written by several threads at
    once while the next chunk is staged; the crc32c runs on one thread, chunk after chunk in file
    order. Buffers come from the pool and go back to it once their write and checksum are done."""

    def __init__(self, path: Path, pool: BufferPool, checksums: bool):
        self.path = path
        self.pool = pool
        self.checksums = checksums
        self.size = 0  # bytes handed out to writes so far: the offset of the next write
        self.crc = 0
        self.tensor = ""  # the tensor being written, for error messages
        self._current: int | None = None  # the pool's buffer being filled
        self._fill = 0  # bytes staged in it
        self._staged_cuda = False  # the current buffer has copies from a GPU in flight
        self._jobs: list[Future] = []  # this file's writes and checksums, in flight
        self._crc_done: Future | None = None  # the last checksum job; each waits for the one before
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
            data = memoryview(flat.view(torch.uint8).numpy())  # keeps the tensor's memory alive
            for start in range(0, len(data), self.pool.chunk_bytes):
                self._jobs.extend(self._submit(data[start : start + self.pool.chunk_bytes], None))
            self._forget_done()
            return
        self._stage(flat, target)

    def _stage(self, flat: torch.Tensor, target: torch.dtype) -> None:
        """Cast and copy into the staging buffers, chunk by chunk; full buffers are written while
        the next ones fill (on CUDA the copies are asynchronous)."""
        itemsize = target.itemsize
        cuda = flat.device.type == "cuda"
        pos, count = 0, flat.numel()
        while pos < count:
            if self._current is None:
                self._current = self.pool.take()
            take = min((self.pool.chunk_bytes - self._fill) // itemsize, count - pos)
            buffer = self.pool.buffers[self._current]
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
            if self._fill == self.pool.chunk_bytes:
                self._rotate()

    def _rotate(self) -> None:
        event = None
        if self._staged_cuda:  # the copies into this buffer are asynchronous: write it once they are done
            event = torch.cuda.Event()
            event.record()
            self._staged_cuda = False
        data = memoryview(self.pool.buffers[self._current][: self._fill].numpy())
        jobs = self._submit(data, event)
        self._jobs.extend(jobs)
        self.pool.give_back(self._current, jobs)
        self._current, self._fill = None, 0
        self._forget_done()

    def _flush_staged(self) -> None:
        if self._fill:
            self._rotate()

    def _forget_done(self) -> None:
        self._jobs = [f for f in self._jobs if not f.done() or f.exception()]

    def write(self, data: memoryview, *, what: str | None = None) -> None:
        """Write bytes now, in order after everything before (the header, a small file's data)."""
        for future in self._submit(data, None, what=what):
            self.pool.result(future)

    def _submit(self, data: memoryview, event, *, what: str | None = None) -> list[Future]:
        """Queue `data` for the next offset; returns its write and checksum jobs."""
        offset, what = self.size, what or f"tensor {self.tensor!r}"
        self.size += len(data)
        jobs = [_writers().submit(_write_at, self.fd, data, offset, event, self.path, what)]
        if self.checksums:
            self._crc_done = _crc_thread().submit(_extend_crc, self, data, event, self._crc_done)
            jobs.append(self._crc_done)
        return jobs

    def finish(self) -> FileEntry:
        self._flush_staged()
        for future in self._jobs:
            self.pool.result(future)
        self._jobs.clear()
        try:
            os.fsync(self.fd)
        except OSError as exc:
            raise write_error(exc, self.path, "the end of the file") from exc
        return FileEntry(size=self.size, crc32c=f"{self.crc:08x}" if self.checksums else None)

    def close(self) -> None:
        for future in self._jobs:
            future.exception()  # waits: nothing may write into the file once it is closed
        self._jobs.clear()
        if self._current is not None:  # a buffer filled but never handed to a job
            self.pool.give_back(self._current, [])
            self._current, self._fill = None, 0
        os.close(self.fd)


def _write_at(fd: int, data: memoryview, offset: int, event, path: Path, what: str) -> None:
    if event is not None:
        event.synchronize()
    try:
        view, at = data, offset
        while view:
            written = os.pwrite(fd, view, at)
            view, at = view[written:], at + written
    except OSError as exc:
        raise write_error(exc, path, what) from exc
    _start_writeback(fd, offset, len(data))


def _extend_crc(sink: ShardFile, data: memoryview, event, previous: Future | None) -> None:
    # The single checksum thread runs jobs in submission order, i.e. in file order.
    if previous is not None:
        previous.result()
    if event is not None:
        event.synchronize()
    sink.crc = crc32c.crc32c(data, sink.crc)


_pools: dict[str, ThreadPoolExecutor] = {}
MAX_WRITER_THREADS = 4


_threads_wanted: int | None = None  # use_writer_threads' setting; None: the default


def writer_threads() -> int:
    """Writer threads, and the shards a spread publish makes: one core is left to the caller.
    Writes into one file serialise in the kernel, so threads only help across files."""
    if _threads_wanted is not None:
        return _threads_wanted
    return max(1, min(MAX_WRITER_THREADS, (os.cpu_count() or 1) - 1))


def use_writer_threads(count: int | None) -> None:
    """Write with `count` threads from now on (None: the default). For measuring."""
    global _threads_wanted
    _threads_wanted = count
    pool = _pools.pop("write", None)
    if pool is not None:
        pool.shutdown(wait=True)


def _writers() -> ThreadPoolExecutor:
    if "write" not in _pools:
        _pools["write"] = ThreadPoolExecutor(max_workers=writer_threads(), thread_name_prefix="pwrite")
    return _pools["write"]


def _crc_thread() -> ThreadPoolExecutor:
    # One thread, so a file's chunks are summed in order; crc32c releases the GIL on large buffers.
    if "crc" not in _pools:
        _pools["crc"] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="crc32c")
    return _pools["crc"]


@functools.cache
def _sync_file_range():
    return getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing this range now (SYNC_FILE_RANGE_WRITE: no wait), so disk
    writes overlap with the next chunk instead of all waiting for the final fsync."""
    fn = _sync_file_range()
    if fn is not None:
        fn(ctypes.c_int(fd), ctypes.c_int64(offset), ctypes.c_int64(nbytes), ctypes.c_uint(2))
