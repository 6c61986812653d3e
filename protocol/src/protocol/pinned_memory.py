"""Pinning a weight slot's shared mapping for the GPU's copies (cudaHostRegister), the same way at
both ends of a slot: the trainer's writer and the worker's reader.

The caller passes CUDA's runtime binding (`torch.cuda.cudart()`): this package never imports torch.

Guarantees:
- a mapping is registered whole: its length rounded up to whole pages, as mmap maps it;
- a call that fails leaves no error behind. A failed CUDA runtime call stays the thread's last
  error, and torch raises that at its next kernel launch as if the launch had failed (on one H200 a
  refused registration made the next `tensor.to()` raise "invalid argument"). torch binds no
  cudaGetLastError, so it is called through ctypes on the runtime library torch loaded;
- a registration left by memory unmapped without unregistering, at the addresses of a mapping
  made just now, is dropped and the new mapping registered in its place;
- a `Pin` is unregistered once, by `release` or when it is dropped, and always before its mapping
  is unmapped: it holds the mapping, so the mapping outlives it.
A registration the kernel refuses (on many kernels a writable file mapping outside tmpfs) leaves
the copies unpinned: correct, and slower; callers log it with `error_text`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os

ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
READ_ONLY = 8  # cudaHostRegisterReadOnly


class Pin:
    """The registration of `mapping` (an mmap, whose first byte is at `address`) for the GPU's
    copies. `pinned` says whether it took; `code` is 0 or the refusal's error code."""

    def __init__(self, cudart, mapping, address: int, size: int, flags: int = 0):
        self.cudart, self.address = cudart, address
        self.code = register(cudart, address, size, flags)
        self._mapping = mapping if self.code == 0 else None  # kept alive while registered

    @property
    def pinned(self) -> bool:
        return self._mapping is not None

    def release(self) -> None:
        if self._mapping is not None:
            self._mapping = None
            unregister(self.cudart, self.address)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the runtime may be gone already
            self.release()


def whole_pages(size: int) -> int:
    """`size` rounded up to whole pages: the length of a mapping of `size` bytes."""
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


def register(cudart, address: int, size: int, flags: int = 0) -> int:
    """cudaHostRegister of the mapping of `size` bytes at `address`, made just now: 0, or the
    error's code (the error cleared)."""
    length = whole_pages(size)
    rc = int(cudart.cudaHostRegister(address, length, flags))
    if rc == ALREADY_REGISTERED:
        # The range was mapped just now, so what is registered there is memory unmapped without
        # cudaHostUnregister, whose stale pages copies to these addresses would reach: drop it
        # (when it starts here) and register again; otherwise the copies run unpinned.
        clear_error()
        if int(cudart.cudaHostUnregister(address)) == 0:
            rc = int(cudart.cudaHostRegister(address, length, flags))
    if rc != 0:
        clear_error()
    return rc


def unregister(cudart, address: int) -> None:
    if int(cudart.cudaHostUnregister(address)) != 0:
        clear_error()  # nothing to undo; only the error must not reach a later call


@functools.cache
def _runtimes() -> tuple[ctypes.CDLL, ...]:
    """The CUDA runtime libraries this process loaded (torch's among them; dlopen of a loaded path
    gives back that same library, with its per-thread last error)."""
    paths: list[str] = []
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            path = fields[5].strip() if len(fields) == 6 else ""
            if os.path.basename(path).startswith("libcudart.so") and path not in paths:
                paths.append(path)
    libraries = []
    for path in paths:
        with contextlib.suppress(OSError):
            libraries.append(ctypes.CDLL(path))
    return tuple(libraries)


def clear_error() -> None:
    """Reset this thread's last CUDA runtime error."""
    for runtime in _runtimes():
        runtime.cudaGetLastError()


def error_text(rc: int) -> str:
    """'error 1, cudaErrorInvalidValue' (the name where the runtime library is found)."""
    for runtime in _runtimes():
        runtime.cudaGetErrorName.restype = ctypes.c_char_p
        return f"error {rc}, {runtime.cudaGetErrorName(rc).decode()}"
    return f"error {rc}"
