"""A LoRA publish: the adapter alone, in PEFT's layout, as the weight sync.

    publish_dir/step_00000012/
        adapter_model.safetensors    the adapter's tensors (PEFT's saved names)
        adapter_config.json          PEFT's config (rank, alpha, target modules, the base's path)
        manifest.json                written last: step, content id, files with crc32c, and
                                     `adapter` (the base model's content id, rank, alpha, targets)

API:

    publish_adapter(step, model, *, publish_dir, base_model, base_content_id, dist_info, run_name=None,
                    dtype=None) -> Published | None
    write_adapter_dir(dest, tensors, config_json, *, step, content_id, adapter, base_model, dtype=None) -> Written

Guarantees:

- The directory follows protocol.weights_dir (one definition of the manifest for this writer and
  every reader): a worker recognises an adapter by the manifest's `adapter`, serves it on the
  base whose content id it names, and never reloads the base for it.
- Atomic and durable as every directory the trainer writes (atomic_dir.building: each file
  fsynced, renamed into place whole); content ids as for full weights (unique per write), so
  pruning, resume and the requests' `weights_content_id` treat an adapter publish as any other.
- Slots and sparse deltas do not apply: an adapter is megabytes, its directory is the sync.

Every rank calls publish_adapter (under FSDP2 the adapter's tensors are gathered one at a time);
rank 0 writes and gets the record, the others None.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from protocol.weights_dir import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MANIFEST,
    STEP_PREFIX,
    Adapter,
    FileEntry,
    Manifest,
    encode_manifest,
    step_content_id,
)

from ..distributed import Distributed
from ..learning.lora import adapter_config_json, adapter_of, adapter_tensors
from .atomic_dir import building, remove_stale_partials
from .publish import Published, published_dir
from .streaming import write_small
from .writer import Written


def publish_adapter(
    step: int,
    model,
    *,
    publish_dir: Path,
    base_model: Path,
    base_content_id: str,
    dist_info: Distributed,
    run_name: str | None = None,
    dtype: torch.dtype | None = None,
) -> Published | None:
    """Write the model's adapter as publish_dir/step_NNNNNNNN (replacing one of that step,
    atomically). dtype None: the adapter's own."""
    tensors = adapter_tensors(model, dist_info)
    if not dist_info.is_main:
        return None
    publish_dir = Path(publish_dir)
    publish_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(publish_dir, STEP_PREFIX)
    content_id = step_content_id(run_name or publish_dir.absolute().parent.name, step)
    written = write_adapter_dir(
        published_dir(publish_dir, step),
        tensors,
        adapter_config_json(model, base_model),
        step=step,
        content_id=content_id,
        adapter=adapter_of(model, base_content_id),
        base_model=base_model,
        dtype=dtype,
    )
    return Published(written.path, step, content_id, written.bytes, written.seconds)


def write_adapter_dir(
    dest: Path,
    tensors: dict[str, torch.Tensor],
    config_json: bytes,
    *,
    step: int,
    content_id: str,
    adapter: Adapter,
    base_model: Path,
    dtype: torch.dtype | None = None,
) -> Written:
    """Write an adapter directory at `dest` (see the module docstring), manifest last."""
    from safetensors.torch import save

    started = time.monotonic()
    if not tensors:
        raise ValueError("the model has no adapter tensors to publish; is [lora] rank set?")
    cast = {name: (t.to(dtype) if dtype is not None else t).contiguous() for name, t in sorted(tensors.items())}
    data = save(cast, metadata={"format": "pt"})  # PEFT writes this metadata too
    with building(Path(dest), files_synced=True) as staging:
        files: dict[str, FileEntry] = {
            ADAPTER_WEIGHTS: write_small(staging / ADAPTER_WEIGHTS, data),
            ADAPTER_CONFIG: write_small(staging / ADAPTER_CONFIG, config_json),
        }
        total = sum(entry.size for entry in files.values())
        manifest = Manifest(
            step=step,
            content_id=content_id,
            base_model=str(base_model),
            dtype=str(next(iter(cast.values())).dtype).removeprefix("torch."),
            bytes=total,
            checksum="crc32c",
            files=files,
            write_seconds=round(time.monotonic() - started, 6),
            created_at=time.time(),
            adapter=adapter,
        )
        write_small(staging / MANIFEST, encode_manifest(manifest))
    return Written(Path(dest), step, content_id, total, time.monotonic() - started, files)
