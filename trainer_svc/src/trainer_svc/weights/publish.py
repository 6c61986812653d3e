"""Published weights: what rollout workers load, one directory per optimizer step,
publish_dir/step_NNNNNNNN/, an HF weights directory written by weights.writer (manifest last).
One process publishes into a publish_dir (rank 0 of the trainer); every rank calls `publish`.

Guarantees:
- A `step_NNNNNNNN` directory is complete whenever it exists (built by atomic_dir). Hidden
  `.step_*.partial` entries are a crashed writer's leftovers; publish and prune remove those whose
  process is gone.
- It follows protocol.weights_dir (names, manifest, content ids). A content id,
  `<run>-step_NNNNNNNN-<8 hex>`, is unique per write, so a worker tells two publications of one
  path apart and a request may demand one (`weights_content_id`).
- Directories are removed by renaming them to a hidden `.partial` name first, then deleting: no
  reader sees a half-deleted step directory under its own name.
- prune_published never removes one of the newest `keep_last`, nor a directory that a request in
  the spool's `requests/` or `claimed/` names (same real path), nor a link the chain of one of
  those needs (a delta's links back to its anchor: protocol.weights_chain.needed). A request file
  that cannot be parsed (deep nesting, not UTF-8, not JSON) protects every directory whose name
  appears in its bytes; one that a worker refuses unread (a FIFO, a symlink, too large) names
  nothing; one that cannot be read (or a listing that keeps changing) stops the prune
  (protocol.spool_names). No request file raises out of a prune or blocks it. A request written while a prune
  runs is seen by a second scan, made once the candidates are out of sight and before anything is
  deleted: what it names is put back (a reader in that instant finds it missing for a moment).
- discard_newer_than removes every step directory after a resumed checkpoint's step: those
  weights belong to steps that will be taken again. Requests still naming them get
  `weights_not_found` from the worker.
- restore_published puts a kept copy of a step directory (a checkpoint's `rollout_weights/`)
  back, byte for byte, content id included, so requests naming it are served as before.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from protocol import weights_chain
from protocol.fsio import fsync_dir
from protocol.spool_names import weights_named
from protocol.weights_dir import (
    STEP_PREFIX,
    ManifestError,
    read_manifest,
    step_content_id,
    step_dir_name,
    step_of,
)

from ..distributed import Begun, Distributed
from .atomic_dir import PARTIAL_SUFFIX, building, remove_stale_partials
from .writer import TensorStream, begin_weights_dir


@dataclass(frozen=True)
class Published:
    path: Path
    step: int
    content_id: str
    bytes: int  # the directory's files, manifest excluded
    seconds: float  # the write, on rank 0 (from the manifest when read back: up to the manifest's write)


def published_dir(publish_dir: Path, step: int) -> Path:
    return Path(publish_dir) / step_dir_name(step)


def publish(step: int, tensors, *, dist_info: Distributed | None = None, **options) -> Published | None:
    """Write `tensors` as publish_dir/step_NNNNNNNN (begin_publish says the options). Returns the
    record on rank 0, None elsewhere."""
    begun = begin_publish(step, tensors, dist_info=dist_info, **options)
    return None if begun is None else begun.finish_on_rank0(dist_info, f"publish step {step}")


def begin_publish(
    step: int,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | TensorStream | None,
    *,
    publish_dir: Path,
    base_model: Path,
    dist_info: Distributed | None = None,
    run_name: str | None = None,
    dtype: torch.dtype | None = None,
    omit: Iterable[str] = (),
    max_shard_bytes: int | None = None,
    checksums: bool = True,
) -> Begun[Published] | None:
    """The write of `tensors` as publish_dir/step_NNNNNNNN (replacing one of that step, atomically),
    begun on every rank for rank 0 to finish (writer.begin_weights_dir; None: a rank without tensors).

    `tensors`: iter_full_tensors(model, dist_info) on every rank (FSDP2: gathered one at a time),
    or a mapping on rank 0. dtype None: bfloat16 for CUDA tensors, the tensors' own on CPU.
    `run_name` prefixes the content id (default: publish_dir's parent's name, the run directory's
    for the default publish_dir, run_dir/weights). checksums=False leaves the crc32c checksums out of the manifest
    (they add 3-28% to a publish on a GPU host, and double it on a busy 2-core CPU: docs/BENCHMARKS.md).
    max_shard_bytes None: one shard per writer thread, written side by side (the fastest; an engine
    reads shards as it reads one file)."""
    publish_dir = Path(publish_dir)
    prefix = run_name or publish_dir.absolute().parent.name
    content_id = step_content_id(prefix, step)
    begun = begin_weights_dir(
        published_dir(publish_dir, step),
        tensors,
        base_model=Path(base_model),
        step=step,
        content_id=content_id,
        dtype=dtype,
        omit=omit,
        max_shard_bytes=max_shard_bytes,
        checksums=checksums,
        dist_info=dist_info,
    )
    if begun is None:
        return None

    def write() -> Published:  # rank 0
        publish_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(publish_dir, STEP_PREFIX)
        written = begun.finish()
        return Published(written.path, step, content_id, written.bytes, written.seconds)

    return Begun(write, begun.drain, begun.agree)


def list_published(publish_dir: Path) -> list[Published]:
    """The complete step directories (with a readable manifest), oldest first."""
    found = []
    for path in _step_dirs(publish_dir):
        try:
            manifest = read_manifest(path)
        except (OSError, ManifestError):
            continue  # not written by publish: left alone, never reported
        if manifest.step is None:
            continue  # an import's manifest, not a publish's
        found.append(
            Published(path, manifest.step, manifest.content_id, manifest.bytes or 0, manifest.write_seconds or 0.0)
        )
    return sorted(found, key=lambda p: p.step)


def latest_published(publish_dir: Path) -> Published | None:
    found = list_published(publish_dir)
    return found[-1] if found else None


def discard_newer_than(publish_dir: Path, step: int) -> list[Path]:
    """Remove every step directory after `step` (complete or not); returns them."""
    doomed = [path for path in _step_dirs(publish_dir) if step_of(path.name) > step]
    _remove(doomed)
    return doomed


def restore_published(copy: Path, publish_dir: Path) -> Published:
    """Put `copy` (a complete step directory, manifest included) back in publish_dir under its
    step, atomically; returns it as found there."""
    manifest = read_manifest(copy)
    if manifest.step is None:
        raise ManifestError(f"{copy}: its manifest names no step; only a published step directory can be restored")
    dest = published_dir(publish_dir, manifest.step)
    with building(dest) as staging:
        shutil.copytree(copy, staging, dirs_exist_ok=True)
    return next(p for p in list_published(publish_dir) if p.path == dest)


def prune_published(publish_dir: Path, keep_last: int, spool_dir: Path | None) -> list[Path]:
    """Remove published directories beyond the newest `keep_last` that no pending or claimed
    request names (spool_dir None: no spool to ask, keep_last alone decides). Returns them."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 (the newest weights are in use), not {keep_last}")
    publish_dir = Path(publish_dir)
    remove_stale_partials(publish_dir, STEP_PREFIX)
    listed = list_published(publish_dir)
    chains = weights_chain.versions(publish_dir)  # a kept delta keeps the links back to its anchor
    kept = {os.path.realpath(path) for path in weights_chain.needed([p.path for p in listed[-keep_last:]], chains)}
    candidates = [p.path for p in listed[:-keep_last] if os.path.realpath(p.path) not in kept]
    if not candidates:
        return []
    if spool_dir is None:
        _delete(_set_aside(candidates))
        return candidates
    candidates = _unnamed(candidates, Path(spool_dir), chains)
    # A request written between the scan and the removal (a producer naming older weights, a
    # worker about to load them) is seen by a second scan once the candidates are out of sight:
    # those it names are put back before anything is deleted.
    aside = _set_aside(candidates)
    doomed = set(_unnamed(candidates, Path(spool_dir), chains))
    for path, hidden in list(aside.items()):
        if path not in doomed:
            os.rename(hidden, path)
            del aside[path]
    _delete(aside)
    return list(aside)


def _unnamed(candidates: list[Path], spool_dir: Path, chains: dict[str, weights_chain.Version]) -> list[Path]:
    """Those of `candidates` that no request in the spool names, nor needs as a link of the chain
    of a delta it names (none when that cannot be known)."""
    named = weights_named(spool_dir)
    if named is None:
        return []
    protected = named.protected(candidates, chains)
    return [path for path in candidates if os.path.realpath(path) not in protected]


def _step_dirs(publish_dir: Path) -> list[Path]:
    try:
        entries = list(Path(publish_dir).iterdir())
    except FileNotFoundError:
        return []
    return sorted((p for p in entries if step_of(p.name) is not None and p.is_dir()), key=lambda p: step_of(p.name))


def _remove(paths: list[Path]) -> None:
    _delete(_set_aside(paths))


def _set_aside(paths: list[Path]) -> dict[Path, Path]:
    """Rename each directory to a hidden sibling: gone from its name at once, deleted out of sight."""
    aside = {}
    for path in paths:
        aside[path] = path.with_name(f".{path.name}.{os.getpid()}{PARTIAL_SUFFIX}")
        os.rename(path, aside[path])
    return aside


def _delete(aside: dict[Path, Path]) -> None:
    if not aside:
        return
    fsync_dir(next(iter(aside)).parent)
    for hidden in aside.values():
        shutil.rmtree(hidden, ignore_errors=True)
