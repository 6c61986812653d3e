"""Chains of published weights: full directories (anchors) and the delta publishes after them.

    publish_dir/step_00000010/   full weights (protocol.weights_dir), manifest without delta_base
    publish_dir/step_00000011/   config and tokenizer files, DELTA_FILE (weight_delta.encode), and a
                                 manifest whose `delta_base` is step 10's content id
    publish_dir/step_00000012/   a delta against step 11's content id, and so on to the next anchor

Guarantees:
- A link is found by content id, never by name or step: a directory written again (a new content
  id) is another version, and a delta names the exact version it applies to (`delta_base`).
- `needed` is the chain a reader with nothing in hand walks: the directory itself, and for a
  delta every link back to the newest full directory on its chain (weight_delta.plan's choice).
  A chain that breaks before a full directory needs what is there (those links are kept; the
  rebuild fails with MissingLink whatever is kept). A pruner that keeps `needed` of every
  directory it must keep never removes a link a rebuild of those reads.
- A directory whose manifest is missing or unreadable is no version (`versions` skips it): a
  publish in progress, or not a publish.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .weight_delta import Link
from .weights_dir import ManifestError, read_manifest, step_of

DELTA_FILE = "weights.delta"  # not *.safetensors: no reader of full directories mistakes it for a shard


@dataclass(frozen=True)
class Version:
    """One step directory as a reader of chains sees it."""

    path: Path
    step: int | None
    content_id: str
    delta_base: str | None  # None: full weights

    @property
    def link(self) -> Link:
        return Link(self.content_id, full=self.delta_base is None, base_id=self.delta_base)


def is_delta_dir(directory: str | os.PathLike) -> bool:
    """Whether `directory` is a delta publish (False for full weights, or no readable manifest)."""
    try:
        return read_manifest(directory).delta_base is not None
    except (OSError, ManifestError):
        return False


def versions(publish_dir: str | os.PathLike) -> dict[str, Version]:
    """The step directories of `publish_dir` with a readable manifest, by content id (of two
    holding one id, the newer step's)."""
    found: dict[str, Version] = {}
    try:
        entries = sorted(Path(publish_dir).iterdir(), key=lambda p: (step_of(p.name) or -1, p.name))
    except FileNotFoundError:
        return found
    for path in entries:
        if step_of(path.name) is None or not path.is_dir():
            continue
        try:
            manifest = read_manifest(path)
        except (OSError, ManifestError):
            continue
        found[manifest.content_id] = Version(path, manifest.step, manifest.content_id, manifest.delta_base)
    return found


def links(found: Mapping[str, Version]) -> dict[str, Link]:
    return {content_id: version.link for content_id, version in found.items()}


def needed(directories: Iterable[str | os.PathLike], found: Mapping[str, Version]) -> set[Path]:
    """Every directory a rebuild of each of `directories` from nothing reads (see the module
    docstring); a directory that is not among `found` needs itself alone."""
    by_path = {os.path.realpath(v.path): v for v in found.values()}
    keep: set[Path] = set()
    for directory in directories:
        version = by_path.get(os.path.realpath(directory))
        if version is None:
            keep.add(Path(directory))
            continue
        seen: set[str] = set()
        while version is not None and version.content_id not in seen:
            seen.add(version.content_id)
            keep.add(version.path)
            if version.delta_base is None:
                break  # a full directory: the walk ends at the newest anchor
            version = found.get(version.delta_base)
    return keep
