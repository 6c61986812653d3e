"""The weight-slot contract: weights published into a ring of flat files in shared memory, which a
worker on the same host maps and copies straight into its engine. One definition for the trainer
that writes a slot and the worker that reads it.

    <slots root, /dev/shm>/<run>-<8 hex>/      a ring, one per run directory
        slot_0/ slot_1/ ...                   at least two slots, reused in turn
            config.json, tokenizer files      copied from the base model: a new engine is built from them
            tensors.bin                       the tensors back to back, each at an offset aligned to ALIGNMENT,
                                              the gaps zero; kept (same file, same inode) across writes, so a
                                              mapping of it (pinned once on a GPU) serves every later write
            slot.json                         the manifest (`SlotManifest`), written last and renamed into
                                              place; removed first when the slot is written again
            readers/<reader>.<pid>.lease      a reader's lease: taken before it reads the manifest, dropped
                                              once its copy of the tensors is made

The ring is private to the user who runs the trainer (mode 0700, its slot directories and readers/
too), and its workers run as that user (a spawned worker does). /dev/shm lets anyone create a
name in it, and the ring's name can be guessed, so a ring is checked before any use (a directory
of this user, not a symlink, that nobody else can write; tensors.bin a regular file of this user
with one link, opened without following links): one that fails is refused (protocol.private_dirs.NotPrivate, naming
the path and what to do), never written through nor read.

A request names a slot as it names a weights directory: `weights_dir` is the slot's directory and
`weights_content_id` its manifest's content id. `cat slot_0/slot.json` shows what a slot holds.

Guarantees:
- A slot with a manifest holds complete weights: the writer removes the manifest before it
  touches tensors.bin and renames the new one into place only after every byte is written, so a
  writer SIGKILLed at any point leaves a slot without a manifest (never read) and the other slots
  as they were; the writer never rewrites the slot holding the newest weights.
- Never under a reader: a reader takes its lease, then reads the manifest; a writer removes the
  manifest, then looks for leases, and waits while one holds (or writes another slot). Either the
  writer sees the lease, or the reader finds no manifest: a reader never copies bytes a writer
  is changing.
- A live reader keeps its lease however long it reads, and a dead reader's lease does not hold a
  slot: a lease of this host (and pid namespace, which a slot's reader shares with its writer) is
  judged by its process alone, held while that process (the pid and its start time, so a reused
  pid does not count) lives; any other is released when its worker's heartbeat in the spool stands
  still past the worker's lease (spool_liveness's rule, judged on the observer's clock) or, with
  no status file for it, when the lease file stood still for DEFAULT_LEASE_S as watched: a reader
  touches its lease every third of that while it holds it.
- Private: a ring, slot or tensors.bin that another user made or can change, or a link in their
  place, is refused by the writer and by every reader before anything is written or mapped.
- The content is checked from the manifest, never by reading the tensors back: `checksum` is the
  sum, modulo 2**64, of tensors.bin's first `bytes` bytes read as little-endian 64-bit words (the
  gaps are zero), printed as 16 hex digits. A reader sums its own copy (on the device, where it
  has one) and compares. Modulo 2**64 the order of the additions does not matter, so a device's
  reduction, numpy's unsigned one and a sum of parts agree, and torch's wrapping int64 sum runs at
  memory speed on CPU and CUDA.
- Decoding checks each field's type and bounds, that tensors lie inside `bytes`, at aligned
  offsets, without overlap, and that shapes and dtypes give each tensor's `nbytes`; a violation
  is a SlotError naming the manifest and the problem.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from . import fsio
from .leases import HeartbeatWatch, process_exists, process_start
from .private_dirs import check_private_dir, make_private_dir, open_private_file

SLOT_MANIFEST = "slot.json"
SLOT_DATA = "tensors.bin"
READERS = "readers"
SLOT_PREFIX = "slot_"
LEASE_SUFFIX = ".lease"
ALIGNMENT = 256  # bytes: every tensor's offset; a device allocation's alignment, so views are as good as tensors
FORMAT = "weight-slot/1"
DEFAULT_LEASE_S = 30.0  # a lease not judged by its process nor a status file: by its own age against this
MANIFEST_MAX_BYTES = 64 * 2**20  # a manifest is a line per tensor: far below this
LEASE_MAX_BYTES = 4096
# Bytes per element of the dtypes a slot holds (torch's names without "torch.").
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}

NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
Hex16 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16}$")]


class SlotError(ValueError):
    """A slot manifest that cannot be read as this contract's: the message names the file and why."""


class SlotTensor(msgspec.Struct, array_like=False, kw_only=True):
    """Where one tensor lies in tensors.bin."""

    dtype: str  # torch's name without "torch." ("bfloat16"), one of DTYPE_BYTES
    shape: list[NonNegativeInt]
    offset: NonNegativeInt  # bytes from the file's start; a multiple of ALIGNMENT
    nbytes: NonNegativeInt  # prod(shape) * the dtype's size


class SlotManifest(msgspec.Struct, kw_only=True):
    """slot.json: the last file written into a slot."""

    format: str = FORMAT  # this contract's version
    step: NonNegativeInt  # the optimizer step whose weights these are
    content_id: Annotated[str, msgspec.Meta(min_length=1)]  # what a request names and a worker reports
    dtype: str  # of the tensors ("bfloat16"): the serving dtype a directory publish would write
    bytes: NonNegativeInt  # of tensors.bin that hold the tensors (the file may be longer); the checksum covers these
    checksum: Hex16  # sum of those bytes as little-endian 64-bit words, modulo 2**64 (the gaps are zero)
    tensors: dict[str, SlotTensor]  # name -> where it lies; the names are the model's state_dict's
    base_model: str | None = None  # the directory config and tokenizer were copied from
    write_seconds: float | None = None  # the write, on the writer's clock
    created_at: float | None = None  # Unix time of the write


def ring_dir(slots_dir: str | os.PathLike, run_dir: str | os.PathLike) -> Path:
    """The ring of a run: <slots_dir>/<run name>-<8 hex of the run directory's real path>, so two
    runs of one name in other directories never share slots."""
    digest = hashlib.sha256(os.path.realpath(run_dir).encode()).hexdigest()[:8]
    return Path(slots_dir) / f"{Path(run_dir).name[:60]}-{digest}"


def _remedy(ring: str | os.PathLike) -> str:
    return (
        "a weight-slot ring must be a directory of this user that nobody else can write, holding no links; "
        f"remove it (rm -r {ring}: a relaunch puts back its weights from the checkpoint) or set "
        "publish.slots_dir to a directory of your own"
    )


def make_ring(ring: str | os.PathLike, count: int) -> None:
    """The writer's ring with `count` slots, each with its readers/: made private (mode 0700) where
    they are not there, checked to be where they are (NotPrivate)."""
    ring = Path(ring)
    ring.parent.mkdir(parents=True, exist_ok=True)
    make_private_dir(ring, _remedy(ring))
    for index in range(count):
        slot = ring / slot_dir_name(index)
        make_private_dir(slot, _remedy(ring))
        make_private_dir(slot / READERS, _remedy(ring))


def check_slot_private(slot_dir: str | os.PathLike) -> None:
    """Before any use of a slot, by its writer or a reader: its ring (the slot's parent), the slot
    and its readers/ (when there) are directories of this user that nobody else can write
    (NotPrivate else, naming the path and what to do)."""
    slot = Path(slot_dir)
    check_private_dir(slot.parent, remedy=_remedy(slot.parent))
    check_private_dir(slot, remedy=_remedy(slot.parent))
    with contextlib.suppress(FileNotFoundError):
        check_private_dir(slot / READERS, remedy=_remedy(slot.parent))


def open_slot_data(slot_dir: str | os.PathLike, flags: int, *, create: bool = False) -> int:
    """An fd of the slot's tensors.bin, after check_slot_private: opened without following a link,
    a regular file of this user with one link (NotPrivate else); `create`: made (O_EXCL) when it
    is not there."""
    check_slot_private(slot_dir)
    path = Path(slot_dir) / SLOT_DATA
    return open_private_file(path, flags, create=create, remedy=_remedy(Path(slot_dir).parent))


def slot_dir_name(index: int) -> str:
    return f"{SLOT_PREFIX}{index}"


def slot_dirs(ring: str | os.PathLike) -> list[Path]:
    """The ring's slot directories, by index (those that exist)."""
    try:
        entries = list(Path(ring).iterdir())
    except FileNotFoundError:
        return []
    found = [p for p in entries if p.name.startswith(SLOT_PREFIX) and p.name[len(SLOT_PREFIX) :].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(SLOT_PREFIX) :]))


def is_slot(directory: str | os.PathLike) -> bool:
    """Whether `directory` is a slot (tensors.bin or slot.json in it), complete or being written."""
    return os.path.exists(os.path.join(directory, SLOT_DATA)) or os.path.exists(os.path.join(directory, SLOT_MANIFEST))


def decode_slot_manifest(data: bytes, where: str) -> SlotManifest:
    try:
        manifest = msgspec.json.decode(data, type=SlotManifest)
    except msgspec.DecodeError as exc:
        raise SlotError(f"{where} is not a slot manifest ({exc}); the slot was not written by the trainer") from None
    problem = _layout_problem(manifest)
    if problem:
        raise SlotError(f"{where}: {problem}; the slot was not written by the trainer")
    return manifest


def _layout_problem(manifest: SlotManifest) -> str | None:
    if manifest.format != FORMAT:
        return f"format {manifest.format!r} is not {FORMAT!r}"
    spans = []
    for name, tensor in manifest.tensors.items():
        if tensor.dtype not in DTYPE_BYTES:
            return f"tensor {name} has dtype {tensor.dtype!r}, not one of {', '.join(DTYPE_BYTES)}"
        if tensor.nbytes != math.prod(tensor.shape) * DTYPE_BYTES[tensor.dtype]:
            return f"tensor {name}: nbytes {tensor.nbytes} does not match shape {tensor.shape} of {tensor.dtype}"
        if tensor.offset % ALIGNMENT or tensor.offset + tensor.nbytes > manifest.bytes:
            return f"tensor {name} at {tensor.offset} (+{tensor.nbytes}) is not aligned or lies past {manifest.bytes}"
        spans.append((tensor.offset, tensor.offset + tensor.nbytes, name))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
        if start < end:
            return f"tensors {first} and {second} overlap"
    return None


def read_slot_manifest(directory: str | os.PathLike) -> SlotManifest:
    """The slot's manifest. FileNotFoundError when it has none (being written, or retired), SlotError
    when it is not a valid one."""
    path = os.path.join(directory, SLOT_MANIFEST)
    try:
        data = fsio.read_regular_file(path, MANIFEST_MAX_BYTES)  # never a FIFO, a link or a file without end
    except ValueError as exc:
        raise SlotError(f"{exc}; the slot was not written by the trainer") from None
    return decode_slot_manifest(data, path)


def encode_slot_manifest(manifest: SlotManifest) -> bytes:
    """JSON a person reads with cat: a field a line, a tensor a line."""
    fields = msgspec.to_builtins(manifest)
    tensors = fields.pop("tensors")
    head = json.dumps(fields, indent=1)[:-2]  # without the closing "\n}"
    rows = ",\n".join(f"  {json.dumps(name)}: {json.dumps(entry)}" for name, entry in tensors.items())
    return f'{head},\n "tensors": {{\n{rows}\n }}\n}}\n'.encode()


def aligned(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def plan_layout(tensors: Iterable[tuple[str, str, list[int] | tuple[int, ...]]]) -> tuple[dict[str, SlotTensor], int]:
    """Offsets in tensors.bin for (name, dtype, shape) in the order given, each aligned; and the
    bytes they span (the last one's end, aligned)."""
    layout, offset = {}, 0
    for name, dtype, shape in tensors:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {name} is {dtype}; a slot holds {', '.join(DTYPE_BYTES)}")
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        layout[name] = SlotTensor(dtype=dtype, shape=list(shape), offset=offset, nbytes=nbytes)
        offset = aligned(offset + nbytes)
    return layout, offset


def word_sum(data) -> int:
    """The checksum's partial sum of a bytes-like whose length is a multiple of 8: its little-endian
    64-bit words added modulo 2**64 (numpy's unsigned sum wraps so by definition)."""
    import numpy as np

    return int(np.frombuffer(data, dtype="<u8").sum(dtype=np.uint64))


def combine_sums(sums: Iterable[int]) -> str:
    """The manifest's checksum from partial sums (of disjoint parts covering `bytes`, each a whole
    number of words; negative ones, as torch's int64 gives them, count modulo 2**64)."""
    return f"{sum(sums) % 2**64:016x}"


# --- leases ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lease:
    path: Path
    reader: str  # a worker id: its status file in the spool is the lease's heartbeat
    pid: int
    host: str
    start: int | None = None  # the process's start (protocol.leases.process_start): a reused pid differs
    pidns: str | None = None  # its pid namespace: a pid means that process only inside it


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _lease_name(reader: str, pid: int) -> str:
    return f"{reader}.{pid}{LEASE_SUFFIX}"


@contextlib.contextmanager
def reading(slot_dir: str | os.PathLike, reader: str, refresh_s: float = DEFAULT_LEASE_S / 3) -> Iterator[Lease]:
    """Hold a reader's lease on `slot_dir` for the body: read the manifest and copy the tensors
    inside it, never before it (the order is what makes a writer wait, see the module docstring).
    The slot is checked to be private first (NotPrivate); the lease file is touched every
    `refresh_s` while held, so a writer that judges it by its age sees it live."""
    slot = Path(slot_dir)
    check_slot_private(slot)
    readers = slot / READERS
    make_private_dir(readers, _remedy(slot.parent))
    pid = os.getpid()
    lease = Lease(
        readers / _lease_name(reader, pid), reader, pid, socket.gethostname(), process_start(pid), _pid_namespace()
    )
    record = {"reader": reader, "pid": pid, "host": lease.host, "start": lease.start, "pidns": lease.pidns}
    body = json.dumps(record | {"taken_at": time.time()}).encode()
    fsio.replace_atomic(lease.path, body, durable=False)  # tmpfs: nothing to make durable
    stop = threading.Event()
    keeper = threading.Thread(target=_keep_fresh, args=(lease.path, refresh_s, stop), name="slot-lease", daemon=True)
    keeper.start()
    try:
        yield lease
    finally:
        stop.set()
        keeper.join()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lease.path)


def _keep_fresh(path: Path, every_s: float, stop: threading.Event) -> None:
    while not stop.wait(every_s):
        with contextlib.suppress(OSError):  # released meanwhile by a judge: the writer has moved on
            os.utime(path, follow_symlinks=False)


def leases(slot_dir: str | os.PathLike) -> list[Lease]:
    """The leases on a slot now (unreadable lease files count, under their names' reader)."""
    found = []
    for entry in _list(Path(slot_dir) / READERS):
        if not entry.name.endswith(LEASE_SUFFIX):
            continue
        try:
            record = json.loads(fsio.read_regular_file(entry, LEASE_MAX_BYTES))
            start, pidns = record.get("start"), record.get("pidns")
            found.append(
                Lease(
                    entry,
                    str(record["reader"]),
                    int(record["pid"]),
                    str(record["host"]),
                    int(start) if start is not None else None,
                    str(pidns) if pidns is not None else None,
                )
            )
        except FileNotFoundError:
            continue  # dropped since the listing
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            reader, _, pid = entry.name.removesuffix(LEASE_SUFFIX).rpartition(".")
            found.append(Lease(entry, reader, int(pid) if pid.isdigit() else -1, ""))
    return found


def _list(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except FileNotFoundError:
        return []


class LeaseJudge:
    """Which leases still hold a slot, by the spool's liveness rules (see the module docstring).

    `spool`: a protocol.spool.Spool whose workers read the slots (None: no spool to ask; leases
    are judged by their processes and their own age). One judge per writer: it remembers what it
    saw of each lease file on its own clock."""

    def __init__(self, spool=None, default_lease_s: float = DEFAULT_LEASE_S, clock=time.monotonic):
        self.spool = spool
        self.default_lease_s = default_lease_s
        self._watch = HeartbeatWatch(clock)
        self._host = socket.gethostname()
        self._pidns = _pid_namespace()

    def held(self, slot_dir: str | os.PathLike) -> list[Lease]:
        """The live leases on `slot_dir`; dead ones are removed (and not returned)."""
        found = leases(slot_dir)
        if not found:
            return []
        statuses = self._statuses()
        fs_now = functools.cache(lambda: time.time())
        live = []
        for lease in found:
            if self._dead(lease, statuses, fs_now):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lease.path)
            else:
                live.append(lease)
        return live

    def _statuses(self) -> dict[str, tuple]:
        if self.spool is None:
            return {}
        return {s.worker_id: (s, seen) for _, s, seen in self.spool.heartbeats() if s is not None}

    def _dead(self, lease: Lease, statuses: dict, fs_now) -> bool:
        if lease.host == self._host and lease.pid > 0 and lease.pidns in (None, self._pidns):
            if lease.start is not None:  # judged by its process alone, however long it reads
                return process_start(lease.pid) != lease.start  # gone, or the pid is another process's now
            if not process_exists(lease.pid):
                return True  # its process is gone: nothing reads under it
        if lease.reader in statuses:
            status, seen = statuses[lease.reader]
            return self.spool._workers_watch.dead(seen, status.lease_s)
        try:
            mtime = lease.path.stat().st_mtime
        except FileNotFoundError:
            return True
        seen = self._watch.look(lease.path.name, mtime, lambda: fs_now() - mtime)
        return self._watch.dead(seen, self.default_lease_s)
