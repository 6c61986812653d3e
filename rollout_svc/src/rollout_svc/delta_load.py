"""Delta publishes, rebuilt into weights an engine loads like any directory.

A delta publish (protocol.weights_chain) holds one encoded delta against an earlier version. The
loader keeps a copy of the weights it last rebuilt (host memory, the bit patterns of the serving
dtype), plans the rebuild of the version named (protocol.weight_delta.plan: from that copy when
the chain reaches it, else from the newest full directory on the chain), applies the deltas in
order and writes the result as a full directory of its own (`cache_dir`, a tmpfs by default):
config and tokenizer files of the named directory, one safetensors file, a manifest with the
named version's content id. The engine then loads that directory through its ordinary in-place
reload, so everything a reload checks (the engine's tensors against the files) holds.

Guarantees:
- Bit-exact: the rebuilt tensors equal those of the full publish of the same step bit for bit
  (the trainer diffs what it published; weight_delta checks each delta applies to the version
  held). The rebuilt directory's content id is the named directory's, so a request's
  `weights_content_id` is checked against it as against any directory.
- A missing link (a delta pruned or never written) is skipped by starting from a newer full
  directory on the chain; when there is none and the copy held is not on the chain either, the
  request fails with weights_not_found naming the version the chain breaks at.
- Every directory read (the named one, through rollout_svc.weight_forms.resolve; each link; the
  anchor) passes the worker's policy (allowed roots) first; a link whose content id changes while
  it is read (republished) is read again, a few times, then the request fails with weights_invalid.
- The cache holds the rebuilt weights of one version at a time; a loader's own cache
  (`rollout-deltas-<pid>-...` in /dev/shm, or the temporary directory when /dev/shm lacks room)
  is removed when the loader goes, and the next loader removes those of processes that are gone.
- A failure leaves the copy held consistent: a delta is applied whole or not at all, and the copy
  is known by the content id of the last version applied.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path

import numpy as np

from protocol import weight_delta, weights_chain
from protocol.messages import ErrorCode
from protocol.private_dirs import make_private_dir
from protocol.weights_dir import (
    COPIED_FILES,
    MANIFEST,
    Manifest,
    encode_manifest,
    read_manifest,
)

from .errors import RequestFailed
from .scratch import own_dir
from .weight_forms import DeltaWeights
from .weights import Weights, WeightsPolicy

log = logging.getLogger(__name__)

REBUILT_FILE = "model.safetensors"
READ_TRIES = 3
_CACHE_PREFIX = "rollout-deltas-"  # + pid + "-" + random: a cache directory of the loader's own
_WIDTHS = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclasses.dataclass
class _Held:
    content_id: str
    tensors: dict[str, np.ndarray]  # name -> bit patterns (unsigned integers of the width)
    dtypes: dict[str, str]  # name -> safetensors dtype ("BF16")


@dataclasses.dataclass(frozen=True)
class Rebuild:
    """What the last rebuild did, for logs and measurement."""

    content_id: str
    full: str | None  # the anchor read (None: started from the copy held)
    deltas: tuple[str, ...]
    read_bytes: int  # of the anchor's shards and the deltas
    changed: int  # elements the deltas wrote
    seconds: float


class DeltaLoader:
    def __init__(self, policy: WeightsPolicy, cache_dir: str | os.PathLike | None = None):
        self.policy = policy
        self._cache_dir = Path(cache_dir) if cache_dir is not None else None  # None: made at the first rebuild
        self._own_cache = cache_dir is None
        self.held: _Held | None = None
        self.last: Rebuild | None = None

    def weights(self, form: DeltaWeights) -> Weights:
        """The Weights an engine loads for the delta publish or anchor `form` (resolved by
        rollout_svc.weight_forms, so its directory passed the policy and its manifest was read):
        the rebuilt directory (see the module docstring). Raises RequestFailed."""
        target = form.manifest
        rebuilt = self.cache_dir / _safe_name(target.content_id)
        if self.held is None or self.held.content_id != target.content_id or not (rebuilt / MANIFEST).is_file():
            self._rebuild(form.path, form.real_path, target)
        weights = WeightsPolicy().inspect(str(rebuilt))  # our own files: no roots to check
        return dataclasses.replace(weights, path=form.path)

    @property
    def cache_dir(self) -> Path:
        if self._cache_dir is None:
            self._cache_dir = _default_cache()
            # Removed with the loader, or at the interpreter's exit.
            weakref.finalize(self, shutil.rmtree, self._cache_dir, ignore_errors=True)
        return self._cache_dir

    def close(self) -> None:
        """Drop the copy held and, when the loader made it, the cache directory."""
        self.held = None
        if self._own_cache and self._cache_dir is not None:
            shutil.rmtree(self._cache_dir, ignore_errors=True)
            self._cache_dir = None

    # -- the rebuild -------------------------------------------------------------------------------

    def _rebuild(self, weights_dir: str, real: str, target: Manifest) -> None:
        started = time.monotonic()
        read = changed = 0
        for attempt in range(READ_TRIES):
            found = weights_chain.versions(os.path.dirname(real))
            if target.content_id not in found:
                raise RequestFailed(
                    ErrorCode.WEIGHTS_NOT_FOUND,
                    f"weights_dir {weights_dir} (content id {target.content_id}) is no longer in "
                    f"{os.path.dirname(real)}; name newer weights",
                )
            held_id = self.held.content_id if self.held is not None else None
            try:
                plan = weight_delta.plan(target.content_id, weights_chain.links(found), held_id)
            except weight_delta.MissingLink as exc:
                raise RequestFailed(
                    ErrorCode.WEIGHTS_NOT_FOUND,
                    f"weights_dir {weights_dir} is a delta publish that cannot be rebuilt: {exc}. This worker "
                    f"holds {held_id or 'no delta chain'}; name a full weights directory, or keep more "
                    "published weights (publish.keep_last) so that the chain back to an anchor stays",
                ) from None
            try:
                if plan.full is not None:
                    read += self._read_full(found[plan.full], weights_dir)
                for content_id in plan.deltas:
                    read_bytes, count = self._apply(found[content_id], weights_dir)
                    read, changed = read + read_bytes, changed + count
            except _Moved as moved:
                log.warning("%s changed while it was read (%s); reading the chain again", weights_dir, moved)
                if attempt + 1 == READ_TRIES:
                    raise RequestFailed(
                        ErrorCode.WEIGHTS_INVALID,
                        f"weights_dir {weights_dir}: the chain it needs kept changing while it was read "
                        f"({moved}); publish each version into a new directory",
                    ) from None
                continue
            self._write(real, target.step)
            self.last = Rebuild(target.content_id, plan.full, plan.deltas, read, changed, time.monotonic() - started)
            log.info(
                "rebuilt %s from %s and %d deltas: %d bytes read, %d elements changed, %.3f s",
                weights_dir, plan.full or "the weights held", len(plan.deltas), read, changed,
                self.last.seconds,
            )  # fmt: skip
            return

    def _read_full(self, version: weights_chain.Version, shown: str) -> int:
        """Hold the full directory `version` (every shard's tensors, as bit patterns)."""
        weights = self.policy.inspect(str(version.path))
        tensors: dict[str, np.ndarray] = {}
        dtypes: dict[str, str] = {}
        for shard in weights.shards:
            header, data = _read_safetensors(Path(weights.real_path) / shard, shown)
            for name, spec in header.items():
                start, end = spec["data_offsets"]
                width = _WIDTHS.get(spec["dtype"])
                if width is None:
                    raise RequestFailed(
                        ErrorCode.WEIGHTS_INVALID,
                        f"weights_dir {shown}: the anchor {version.path} holds {name} as {spec['dtype']}, which "
                        "deltas do not rebuild; publish full weights",
                    )
                bits = np.frombuffer(data[start:end], dtype=np.dtype(f"<u{width}")).copy()
                tensors[name] = bits.reshape(spec["shape"])
                dtypes[name] = spec["dtype"]
        if read_manifest(version.path).content_id != version.content_id:
            raise _Moved(f"{version.path} was republished")
        self.held = _Held(version.content_id, tensors, dtypes)
        return weights.size_bytes

    def _apply(self, version: weights_chain.Version, shown: str) -> tuple[int, int]:
        """Apply the delta publish `version` to the copy held; (bytes read, elements changed)."""
        self.policy.check_files_allowed(self.policy.check_allowed(str(version.path)), shown)
        path = version.path / weights_chain.DELTA_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise _Moved(f"{path} is gone") from None
        except OSError as exc:
            raise RequestFailed(ErrorCode.WEIGHTS_INVALID, f"weights_dir {shown}: cannot read {path} ({exc})") from None
        try:
            delta = weight_delta.decode(data)
        except weight_delta.DeltaInvalid as exc:
            raise RequestFailed(ErrorCode.WEIGHTS_INVALID, f"weights_dir {shown}: {path}: {exc}") from None
        if delta.content_id != version.content_id:
            raise _Moved(f"{path} holds {delta.content_id}, its manifest says {version.content_id}")
        try:
            weight_delta.apply_model(self.held.tensors, delta, held_id=self.held.content_id)
        except weight_delta.MissingLink as exc:
            raise _Moved(str(exc)) from None
        except weight_delta.DeltaInvalid as exc:
            raise RequestFailed(
                ErrorCode.WEIGHTS_INVALID,
                f"weights_dir {shown}: {path} does not fit the weights it applies to ({exc}); publish full weights",
            ) from None
        self.held.content_id = delta.content_id
        return len(data), delta.changed

    def _write(self, real: str, step: int | None) -> None:
        """The copy held as a full directory in the cache (staged, renamed into place). The
        directories of earlier versions go first (the engine has loaded them already); a cache
        of the loader's own that lacks room for the weights (a container's /dev/shm is 64 MB by
        default) moves to the temporary directory."""
        if self._own_cache:  # in a shared /dev/shm or /tmp: made again private, never someone else's
            make_private_dir(self.cache_dir)
        else:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        for old in self.cache_dir.iterdir():
            shutil.rmtree(old, ignore_errors=True)
        needed = sum(array.nbytes for array in self.held.tensors.values()) + 2**20
        if self._own_cache and shutil.disk_usage(self.cache_dir).free < needed:
            log.warning(
                "%s has less room than the %d bytes of the rebuilt weights; rebuilding in %s instead",
                self.cache_dir, needed, tempfile.gettempdir(),
            )  # fmt: skip
            shutil.rmtree(self.cache_dir, ignore_errors=True)
            self._cache_dir = own_dir(Path(tempfile.gettempdir()), _CACHE_PREFIX)
            weakref.finalize(self, shutil.rmtree, self._cache_dir, ignore_errors=True)
        dest = self.cache_dir / _safe_name(self.held.content_id)
        staging = self.cache_dir / f".{dest.name}.{os.getpid()}.partial"
        staging.mkdir()
        try:
            for name in COPIED_FILES:
                if os.path.isfile(os.path.join(real, name)):
                    shutil.copyfile(os.path.join(real, name), staging / name)
            _write_safetensors(staging / REBUILT_FILE, self.held)
            manifest = Manifest(content_id=self.held.content_id, step=step)
            (staging / MANIFEST).write_bytes(encode_manifest(manifest))
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise RequestFailed(
                ErrorCode.ENGINE_ERROR,
                f"the rebuilt weights of {real} cannot be written to {self.cache_dir} ({exc}); free space there",
            ) from None
        os.rename(staging, dest)


class _Moved(Exception):
    """A link changed while the chain was read: read it again."""


def _default_cache() -> Path:
    """A directory of this process in /dev/shm (memory, like the engine's reload source), else in
    the temporary directory."""
    return own_dir(Path("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()), _CACHE_PREFIX)


def _safe_name(content_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in content_id).lstrip(".") or "weights"


def _read_safetensors(path: Path, shown: str) -> tuple[dict, bytes]:
    try:
        data = path.read_bytes()
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + length])
        header.pop("__metadata__", None)
        return header, memoryview(data)[8 + length :]
    except (OSError, ValueError) as exc:
        raise RequestFailed(
            ErrorCode.WEIGHTS_INVALID, f"weights_dir {shown}: {path} is not a readable safetensors file ({exc})"
        ) from None


def _write_safetensors(path: Path, held: _Held) -> None:
    """The tensors held as one safetensors file (sorted by name, as the trainer writes them)."""
    header: dict = {}
    offset = 0
    names = sorted(held.tensors)
    for name in names:
        size = held.tensors[name].nbytes
        header[name] = {
            "dtype": held.dtypes[name],
            "shape": list(held.tensors[name].shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name in names:
            f.write(np.ascontiguousarray(held.tensors[name]).reshape(-1).view(np.uint8).data)  # little-endian bits
