"""A weights directory checked against its manifest (protocol.weights_dir), file by file: what the
writers' tests assert about what they wrote. Shared by the trainer tier and the GPU tier.

No service runs this check: a worker trusts the manifest's content id (and checks, after each
reload, that the engine's tensors equal the files'), and the writers' directories are renamed
into place whole, so reading every file back would only double the cost of a load."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import crc32c

from protocol.weights_dir import MANIFEST, Manifest, ManifestError, read_manifest

# The checksums a manifest may name: crc32c is what the writers compute; zlib's crc32 is what
# directories written before crc32c carry.
CHECKSUMS = {"crc32c": crc32c.crc32c, "crc32": zlib.crc32}
_CHUNK = 16 * 2**20


class WeightsCorrupt(ValueError):
    """A weights directory whose manifest, files, sizes or checksums do not agree."""


def verify(path: Path, *, checksums: bool = False) -> Manifest:
    """Check a weights directory against its manifest; returns the manifest.

    Every listed file must exist with its recorded size, and every safetensors file present must be
    listed; with checksums=True each file is read back and its checksum compared (files written with
    checksums=False have none: their size alone is checked). Raises WeightsCorrupt."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except (OSError, ManifestError) as exc:
        raise WeightsCorrupt(f"{path}: no readable {MANIFEST} ({exc}); the directory is incomplete") from exc
    files = manifest.files or {}
    unlisted = sorted(p.name for p in path.glob("*.safetensors") if p.name not in files)
    if unlisted:
        raise WeightsCorrupt(f"{path}: {', '.join(unlisted)} not in {MANIFEST}")
    for name, entry in files.items():
        try:
            size = os.stat(path / name).st_size
        except OSError as exc:
            raise WeightsCorrupt(f"{path}: {name} is listed in {MANIFEST} but unreadable ({exc})") from exc
        if size != entry.size:
            raise WeightsCorrupt(f"{path}: {name} has {size} bytes, the manifest says {entry.size}")
        recorded = getattr(entry, manifest.checksum) if manifest.checksum in CHECKSUMS else None
        if checksums and recorded is not None and _checksum(path / name, manifest.checksum) != int(recorded, 16):
            raise WeightsCorrupt(f"{path}: {name} does not match its {manifest.checksum} in {MANIFEST}")
    return manifest


def _checksum(path: Path, algorithm: str) -> int:
    update, value = CHECKSUMS[algorithm], 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            value = update(chunk, value)
    return value
