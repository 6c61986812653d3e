"""Write a model's weights as a Hugging Face directory, ourselves, at the speed of the medium:
config and tokenizer files copied from the base model, the tensors as safetensors (one file, or
shards and their index; the bytes equal save_pretrained's, tested), and manifest.json last
(protocol.weights_dir's Manifest).

`tensors` is a mapping, (name, tensor) pairs, or a TensorStream: names, shapes and dtypes known up
front (a safetensors header comes before the data), tensors produced one at a time in the order
the writer asks for. Names are the model's state_dict names, which save_pretrained writes for
models without a checkpoint conversion mapping.

Guarantees:
- Atomic (atomic_dir): a reader sees no directory, the previous complete one, or the new complete
  one, even if the writer is SIGKILLed at any point (tested). Durable: one fsync per file, one for
  the directory, one for its parent.
- The manifest is the last file written: step, content id, dtype, bytes, each file's size and
  crc32c (computed on the chunks as they are written, no extra read).
- Streaming (weights.streaming): tensors go from their device to the file in chunks (CUDA tensors
  cast on the device, through pinned buffers, written by several threads at their offsets); shards
  are filled side by side, since the kernel serialises buffered writes into one file, not several.
- Bad input is refused before anything is written where it is known up front, else when the
  tensor arrives; the error names the tensor and what to do. A failed write (a full disk) names
  the file and the tensor. Either way the staging goes and any previous `dest` is untouched.
- Under FSDP2 every rank calls write_weights_dir with iter_full_tensors: each parameter is gathered
  in turn and written by rank 0, so the whole model is never in one process's memory; if rank 0
  fails, the others still finish the gathers and every rank raises (distributed.on_rank0).
  begin_weights_dir is the same write for a caller that finishes it with its own rank-0 work.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from protocol.weights_dir import COPIED_FILES, MANIFEST, FileEntry, Manifest, encode_manifest

from ..distributed import Begun, Distributed
from .atomic_dir import building
from .streaming import (
    SAFETENSORS_DTYPES,
    BufferPool,
    Buffers,
    ShardFile,
    header,
    write_small,
    writer_threads,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_CHUNK_BYTES = 64 * 2**20
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # the shard size most published checkpoints use
# max_shard_bytes=None: a model is spread over one shard per writer thread, so its files are
# written side by side; models under this size stay in one file.
MIN_SPREAD_SHARD_BYTES = 256 * 2**20


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device  # where the tensor will come from (a DTensor's local device)

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n


class TensorStream:
    """Tensors known by name, shape and dtype up front, produced one at a time.

    `fetch(names)` yields (name, tensor) in the order asked for; iterating the stream yields them
    in the order of `specs`. A `collective` stream must be consumed in the same order on every
    rank (each tensor is an all-gather); only rank 0's tensors are meaningful.
    """

    def __init__(
        self,
        specs: Iterable[TensorSpec],
        fetch: Callable[[list[str]], Iterator[tuple[str, torch.Tensor]]],
        *,
        collective: bool = False,
    ):
        self.specs = tuple(specs)
        self.fetch = fetch
        self.collective = collective

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.fetch([spec.name for spec in self.specs])


@dataclass(frozen=True)
class Written:
    path: Path
    step: int
    content_id: str
    bytes: int  # every file but the manifest
    seconds: float  # from the call to the rename into place, on rank 0
    files: dict[str, FileEntry]  # as in the manifest


def serving_dtype(device: torch.device | str) -> torch.dtype | None:
    """The dtype rollout engines serve in: bfloat16 on GPU; None (keep the tensors' own) elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else None


def omitted_names(model) -> set[str]:
    """State-dict names save_pretrained leaves out: tied duplicates (lm_head.weight when it is
    embed_tokens.weight) and the model's `_keys_to_ignore_on_save`.

    Among names sharing one parameter, those matching the model's declared tied keys are dropped
    (in sorted order) until one is left, as transformers does; undeclared aliases keep the first
    name in state-dict order."""
    import re

    state = model.state_dict(keep_vars=True)  # tied names map to the same Parameter object
    groups: dict[int, list[str]] = {}
    for name, value in state.items():
        groups.setdefault(id(value), []).append(name)
    patterns = []
    for prefix, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or {}
        patterns += [f"{prefix}.{key}" if prefix else key for key in tied]
    omit = {name for name in (getattr(model, "_keys_to_ignore_on_save", None) or ()) if name in state}
    for names in groups.values():
        if len(names) < 2:
            continue
        kept = list(names)
        for name in sorted(names):
            if len(kept) > 1 and any(re.search(pattern, name) for pattern in patterns):
                kept.remove(name)
        omit.update(name for name in names if name != kept[0])
    return omit


def iter_full_tensors(model, dist_info: Distributed) -> TensorStream:
    """The model's weights as save_pretrained would save them, one full tensor at a time.

    Every rank must call it and consume the stream in the same order (the writer does). Under
    FSDP2 each DTensor parameter is gathered with full_tensor() when the writer asks for it; its
    result is meaningful on rank 0 only. On one process the tensors are the model's own, no copy."""
    from torch.distributed.tensor import DTensor

    omit = omitted_names(model)
    state = {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in omit}
    specs = [TensorSpec(k, tuple(v.shape), v.dtype, v.device) for k, v in state.items()]

    def fetch(names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            value = state[name]
            with torch.no_grad():
                full = value.full_tensor() if isinstance(value, DTensor) else value
            yield name, full.detach()
            del full  # freed before the next gather, so at most one gathered tensor is alive

    collective = dist_info.world_size > 1 and any(isinstance(v, DTensor) for v in state.values())
    return TensorStream(specs, fetch, collective=collective)


def as_stream(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | TensorStream, omit: Iterable[str] = ()
) -> TensorStream:
    """A mapping, or (name, tensor) pairs, become a stream; of names aliasing one tensor (tied
    weights) the first is kept. Pairs are collected first (all their tensors held at once): to
    stream, pass a TensorStream."""
    omit = set(omit)
    if isinstance(tensors, TensorStream):
        if not omit:
            return tensors
        specs = [spec for spec in tensors.specs if spec.name not in omit]
        return TensorStream(specs, tensors.fetch, collective=tensors.collective)
    if not isinstance(tensors, Mapping):
        tensors = _collect(tensors)
    seen: set[tuple] = set()
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in omit:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor; leave it out")
        _check_tensor(name, tensor)
        alias = (
            (
                tensor.device,
                tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(),
                tuple(tensor.shape),
                tensor.dtype,
            )
            if tensor.numel()
            else None
        )
        if alias is not None and alias in seen:
            continue  # safetensors holds no aliases; save_pretrained drops tied duplicates too
        if alias is not None:
            seen.add(alias)
        kept[name] = tensor
    specs = [TensorSpec(k, tuple(v.shape), v.dtype, v.device) for k, v in kept.items()]
    return TensorStream(specs, lambda names: ((name, kept[name]) for name in names))


def _collect(pairs) -> dict[str, torch.Tensor]:
    try:
        collected = {}
        for name, tensor in pairs:
            if not isinstance(name, str):
                raise TypeError(f"a name is a {type(name).__name__}")
            if name in collected:
                raise ValueError(f"tensor {name!r} comes twice; names must be unique")
            collected[name] = tensor
        return collected
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"tensors must be a mapping name -> tensor, (name, tensor) pairs or a TensorStream ({exc})"
        ) from exc


def write_weights_dir(dest: Path, tensors, *, dist_info: Distributed | None = None, **options) -> Written | None:
    """Write `tensors` as an HF weights directory at `dest` (begin_weights_dir says the options).
    With a collective stream every rank calls this; rank 0 writes and returns Written, others
    return None. With a mapping only rank 0 needs to call it (other ranks may pass None)."""
    begun = begin_weights_dir(dest, tensors, dist_info=dist_info, **options)
    return None if begun is None else begun.finish_on_rank0(dist_info, f"write {dest}")


def begin_weights_dir(
    dest: Path,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | TensorStream | None,
    *,
    base_model: Path,
    step: int,
    content_id: str,
    dtype: torch.dtype | None = None,
    omit: Iterable[str] = (),
    max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    checksums: bool = True,
    dist_info: Distributed | None = None,
) -> Begun[Written] | None:
    """The write of `tensors` as an HF weights directory at `dest` (see the module docstring),
    checked and planned on every rank, for rank 0 to finish (None: a rank without tensors).

    `dtype` is the dtype written (None: bfloat16 for CUDA tensors, the tensors' own on CPU).
    `max_shard_bytes` None spreads the weights over one shard per writer thread (at least
    MIN_SPREAD_SHARD_BYTES each), which are then written side by side: the fastest layout."""
    started = time.monotonic()
    dest = Path(dest)
    main = dist_info is None or dist_info.is_main
    if tensors is None:
        if main:
            raise ValueError("rank 0 has no tensors to write")
        return None
    stream = as_stream(tensors, omit)
    if stream.collective and dist_info is None:
        raise ValueError("a collective stream (FSDP) needs dist_info: every rank would write otherwise")
    target = dtype or _default_dtype(stream.specs)
    for spec in stream.specs:
        _check_spec(spec)
    if target not in SAFETENSORS_DTYPES:
        raise ValueError(f"cannot write dtype {target}; choose one of {', '.join(map(str, SAFETENSORS_DTYPES))}")
    if chunk_bytes < 4096 or chunk_bytes % 8:
        raise ValueError(f"chunk_bytes must be a multiple of 8 and at least 4096, not {chunk_bytes}")
    if max_shard_bytes is None:
        total = sum(spec.numel for spec in stream.specs) * target.itemsize
        max_shard_bytes = max(MIN_SPREAD_SHARD_BYTES, -(-total // writer_threads()))
    shards = _plan_shards(stream.specs, target, max_shard_bytes)
    source = stream.fetch([spec.name for spec in _side_by_side(shards)])
    return Begun(
        lambda: _write(
            dest, source, shards, Path(base_model), step, content_id, target, chunk_bytes, checksums, started
        ),
        drain=source if stream.collective else (),
        agree=stream.collective,  # collective only with several ranks and dist_info (checked above)
    )


# --- internals -------------------------------------------------------------------------------


def _check_tensor(name: str, tensor: torch.Tensor) -> None:
    _check_spec(TensorSpec(name, tuple(tensor.shape), tensor.dtype, tensor.device))
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor {name!r} has layout {tensor.layout}; pass a dense tensor (tensor.to_dense())")
    if not tensor.is_contiguous():
        raise ValueError(f"tensor {name!r} is not contiguous (a transposed or sliced view?); pass tensor.contiguous()")


def _check_spec(spec: TensorSpec) -> None:
    if not spec.dtype.is_floating_point:
        raise ValueError(
            f"tensor {spec.name!r} has dtype {spec.dtype}; published weights hold floating-point "
            "tensors only: leave it out (omit=...) or cast it"
        )
    if spec.device.type == "meta":
        raise ValueError(f"tensor {spec.name!r} is on the meta device (no data); materialise the model first")


def _default_dtype(specs: tuple[TensorSpec, ...]) -> torch.dtype:
    if any(spec.device.type == "cuda" for spec in specs):
        return torch.bfloat16
    dtypes = {spec.dtype for spec in specs}
    if len(dtypes) != 1:
        raise ValueError(f"the tensors have dtypes {sorted(map(str, dtypes))}; pass dtype= to choose one")
    return dtypes.pop()


def _plan_shards(specs: tuple[TensorSpec, ...], target: torch.dtype, max_bytes: int) -> list[list[TensorSpec]]:
    """save_pretrained's split: names in natural order (layer 2 before layer 10), a new shard when
    the next tensor would pass max_bytes, a tensor larger than max_bytes alone in its own; within
    a shard, sorted by name (safetensors' order)."""
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in sorted(specs, key=lambda spec: _natural_key(spec.name)):
        nbytes = spec.numel * target.itemsize
        if nbytes > max_bytes:
            shards.append([spec])
            continue
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return [sorted(shard, key=lambda spec: spec.name) for shard in shards]


def _natural_key(name: str) -> tuple:
    # transformers' dot_natural_key: numbers compare as numbers, and sort before words
    parts = []
    for part in name.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
        else:
            text = part.rstrip("0123456789")
            parts.append((1, text, int(part[len(text) :])) if len(text) < len(part) else (1, part))
    return tuple(parts)


def _side_by_side(shards: list[list[TensorSpec]]) -> list[TensorSpec]:
    """The tensors in the order they are written: one of each shard in turn (each shard's own in
    its file order), so the shards' files are filled side by side, each by its own writer thread
    (buffered writes into one file are serialised by the kernel; into several, they are not)."""
    return [spec for row in itertools.zip_longest(*shards) for spec in row if spec is not None]


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _write(dest, source, shards, base_model, step, content_id, target, chunk_bytes, checksums, started) -> Written:
    if not (base_model / "config.json").is_file():
        raise FileNotFoundError(f"{base_model} has no config.json: name the base model directory to copy it from")
    with building(dest, files_synced=True) as staging:  # each file fsynced as written
        files: dict[str, FileEntry] = {}
        names = _shard_names(len(shards))
        weight_map = {spec.name: name for shard, name in zip(shards, names, strict=True) for spec in shard}
        pinned = any(spec.device.type == "cuda" for shard in shards for spec in shard)
        pool = BufferPool(Buffers(chunk_bytes, pinned, BufferPool.size_for(len(shards))))
        sinks: dict[str, ShardFile] = {}
        try:
            for shard, name in zip(shards, names, strict=True):
                sinks[name] = ShardFile(staging / name, pool, checksums)
                sinks[name].write(memoryview(header([(s.name, s.shape) for s in shard], target)), what="the header")
            for spec in _side_by_side(shards):  # the order write_weights_dir fetches in
                tensor_name, tensor = next(source, (None, None))
                _check_arrival(spec, tensor_name, tensor)
                sinks[weight_map[spec.name]].append(spec.name, tensor, target)
                del tensor  # under FSDP a gathered tensor is freed before the next is gathered
            for name, sink in sinks.items():
                files[name] = sink.finish()
        finally:
            for sink in sinks.values():
                sink.close()
        if len(shards) > 1:
            total = sum(spec.numel * target.itemsize for shard in shards for spec in shard)
            params = sum(spec.numel for shard in shards for spec in shard)
            index = {"metadata": {"total_parameters": params, "total_size": total}, "weight_map": weight_map}
            index_bytes = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
            files[INDEX_FILE] = write_small(staging / INDEX_FILE, index_bytes)
        total_bytes = finish_published(
            staging, files, base_model, step, content_id, target, "crc32c" if checksums else None, started
        )
    return Written(dest, step, content_id, total_bytes, time.monotonic() - started, files)


def finish_published(
    staging: Path,
    files: dict[str, FileEntry],
    base_model: Path,
    step: int,
    content_id: str,
    dtype: torch.dtype,
    checksum: str | None,
    started: float,
    delta_base: str | None = None,
) -> int:
    """A published directory's last files: the config and tokenizer files copied from
    `base_model` beside `files`, then the manifest naming them all. Returns the bytes of every file
    but the manifest."""
    for name in COPIED_FILES:
        if (base_model / name).is_file():
            files[name] = write_small(staging / name, (base_model / name).read_bytes())
    total_bytes = sum(entry.size for entry in files.values())
    manifest = Manifest(
        step=step,
        content_id=content_id,
        base_model=str(base_model),
        dtype=str(dtype).removeprefix("torch."),
        bytes=total_bytes,
        checksum=checksum,
        files=files,
        write_seconds=round(time.monotonic() - started, 6),
        created_at=time.time(),
        delta_base=delta_base,
    )
    write_small(staging / MANIFEST, encode_manifest(manifest))
    return total_bytes


def _check_arrival(spec: TensorSpec, name: str, tensor: torch.Tensor) -> None:
    if name is None:
        raise ValueError(f"the tensor stream ended before {spec.name!r}, which its specs announce")
    if name != spec.name:
        raise ValueError(f"the tensor stream yielded {name!r} where {spec.name!r} was asked for")
    if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
        raise ValueError(
            f"tensor {name!r} arrived as {tensor.dtype} {tuple(tensor.shape)}, announced as "
            f"{spec.dtype} {spec.shape}; a stream's specs must describe its tensors"
        )
    _check_tensor(name, tensor)
