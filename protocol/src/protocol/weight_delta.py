"""Sparse weight deltas: a publish written as the elements that changed since the one before it.

Tensors are numpy arrays of bit patterns: a bfloat16 tensor is its uint16 view (on the trainer,
`tensor.view(torch.int16).numpy().view(numpy.uint16)`, no copy; numpy has no bfloat16). Any dtype
works the same way: elements are compared and copied as unsigned integers of their width, never as
numbers, so NaN payloads, -0.0 and infinities change and apply like any other bits.

Guarantees:
- Bit-exact: apply(old, diff(old, new)) leaves old equal to new bit for bit; so does a chain
  (anchor, then each delta of the chain in order), as long as every delta was taken against the
  exact bits published before it (the trainer diffs what it published, its serving-dtype copy,
  never its float32 master weights). Tested on random chains, with NaNs and signed zeros.
- A delta names the content id it applies to (`base_id`) and the one it gives (`content_id`);
  apply_model refuses weights holding another version (MissingLink), and apply refuses a delta of
  another shape, dtype or out-of-range indices, so a link never lands on the wrong weights.
- plan() finds the cheapest rebuild from what exists: the deltas from the version held when the
  chain from the target back reaches it, else the newest full copy on that chain and the deltas
  after it. A missing link (a delta pruned or never written) is skipped by starting from a full
  copy newer than the gap; with none, MissingLink names the missing version.
- encode() writes a valid safetensors file: per tensor `<name>:indices` (U32, or U64 past 2**32
  elements) and `<name>:values` (the bit patterns' unsigned type), with the ids, shapes and
  dtypes in its metadata; decode() reads it back equal, and refuses anything else with a message
  naming what is wrong.

Whether a delta pays is the caller's choice: `delta.nbytes` against the full tensors' bytes (an
index and a value per changed element: at bfloat16 a delta is smaller while fewer than a third of
the elements change).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import numpy as np

FORMAT = "weight-delta-1"
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SAFETENSORS_DTYPES = {np.dtype(np.uint8): "U8", np.dtype(np.uint16): "U16", np.dtype(np.uint32): "U32"}
_SAFETENSORS_DTYPES[np.dtype(np.uint64)] = "U64"
_NUMPY_DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}


class MissingLink(ValueError):
    """A delta cannot be applied: the version it is against is not the one held, or not there."""


class DeltaInvalid(ValueError):
    """A delta that does not fit its tensor, or bytes that are not an encoded delta."""


@dataclass(frozen=True)
class TensorDelta:
    """The changed elements of one tensor."""

    shape: tuple[int, ...]
    dtype: np.dtype  # of the bit patterns (an unsigned integer type of the tensor's width)
    indices: np.ndarray  # (changed,) uint32 or uint64: flat positions, increasing
    values: np.ndarray  # (changed,) `dtype`: the new bits at those positions

    @property
    def nbytes(self) -> int:
        return self.indices.nbytes + self.values.nbytes


@dataclass(frozen=True)
class ModelDelta:
    """A whole publish as a delta: from the weights of content id `base_id` to `content_id`'s."""

    base_id: str
    content_id: str
    tensors: dict[str, TensorDelta]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def changed(self) -> int:
        return sum(t.indices.size for t in self.tensors.values())


def bits(array: np.ndarray) -> np.ndarray:
    """The array's elements as unsigned integers of their width (a view, no copy)."""
    try:
        return array.view(_UNSIGNED[array.dtype.itemsize])
    except KeyError:
        raise DeltaInvalid(f"elements of {array.dtype.itemsize} bytes cannot be diffed; use 1, 2, 4 or 8") from None


def diff(old: np.ndarray, new: np.ndarray) -> TensorDelta:
    """The elements of `new` whose bits differ from `old`'s (same shape and dtype)."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise DeltaInvalid(
            f"cannot diff {old.dtype} {old.shape} against {new.dtype} {new.shape}: shapes and dtypes differ"
        )
    old_bits, new_bits = bits(np.ascontiguousarray(old)).reshape(-1), bits(np.ascontiguousarray(new)).reshape(-1)
    index_type = np.uint32 if new_bits.size <= 2**32 else np.uint64
    indices = np.flatnonzero(old_bits != new_bits).astype(index_type)
    return TensorDelta(tuple(new.shape), new_bits.dtype, indices, new_bits[indices])


def apply(target: np.ndarray, delta: TensorDelta) -> None:
    """Write the delta's values into `target` (C-contiguous, the delta's shape and width), in place."""
    if tuple(target.shape) != delta.shape or target.dtype.itemsize != delta.dtype.itemsize:
        raise DeltaInvalid(
            f"a delta of {delta.dtype} {delta.shape} cannot apply to {target.dtype} {tuple(target.shape)}"
        )
    if not target.flags.c_contiguous:
        raise DeltaInvalid("the target is not C-contiguous; apply to np.ascontiguousarray(target) and keep that")
    if delta.indices.size != delta.values.size:
        raise DeltaInvalid(f"{delta.indices.size} indices but {delta.values.size} values")
    flat = bits(target).reshape(-1)
    if delta.indices.size and int(delta.indices.max()) >= flat.size:
        raise DeltaInvalid(f"an index {int(delta.indices.max())} is past the tensor's {flat.size} elements")
    flat[delta.indices] = delta.values


def diff_model(
    old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray], *, base_id: str, content_id: str
) -> ModelDelta:
    """Every tensor's delta from `old` (the weights of `base_id`) to `new` (those of `content_id`).
    Both must hold the same names: a model whose tensors change name or shape is published whole."""
    if set(old) != set(new):
        missing, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
        raise DeltaInvalid(f"the tensors differ (gone: {missing[:5]}, new: {added[:5]}); publish the weights whole")
    return ModelDelta(base_id, content_id, {name: diff(old[name], new[name]) for name in sorted(new)})


def apply_model(weights: MutableMapping[str, np.ndarray], delta: ModelDelta, *, held_id: str) -> None:
    """Apply `delta` to `weights`, which hold the version `held_id`, in place. Every tensor is
    checked before any is changed, so a refused delta leaves the weights as they were."""
    if held_id != delta.base_id:
        raise MissingLink(f"the delta to {delta.content_id} applies to {delta.base_id}, the weights held are {held_id}")
    if set(weights) != set(delta.tensors):
        raise DeltaInvalid(f"the delta to {delta.content_id} names other tensors than the weights held")
    for name, tensor_delta in delta.tensors.items():
        target = weights[name]
        if tuple(target.shape) != tensor_delta.shape or target.dtype.itemsize != tensor_delta.dtype.itemsize:
            raise DeltaInvalid(
                f"{name}: the delta is {tensor_delta.dtype} {tensor_delta.shape}, the weights hold "
                f"{target.dtype} {tuple(target.shape)}"
            )
    for name, tensor_delta in delta.tensors.items():
        apply(weights[name], tensor_delta)


# --- the chain -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One published version, as a reader finds it: a full copy, a delta against `base_id`, or both."""

    content_id: str
    full: bool  # the whole weights are there (an anchor)
    base_id: str | None  # the version its delta applies to (None: no delta)


@dataclass(frozen=True)
class Plan:
    """How to rebuild a version: load `full` (None: start from the weights held), then apply the
    deltas of `deltas` in order."""

    full: str | None
    deltas: tuple[str, ...]


def plan(target_id: str, links: Mapping[str, Link], held_id: str | None = None) -> Plan:
    """The rebuild of `target_id` from what `links` offers and the version held (see the module
    docstring). Raises MissingLink when neither the held version nor a full copy is reachable."""
    chain: list[str] = []  # the versions walked back from the target, newest first
    newest_full = None
    current = target_id
    while True:
        if current == held_id:
            return Plan(None, tuple(reversed(chain)))
        link = links.get(current)
        if link is None:
            break
        if link.full and newest_full is None:
            newest_full = (current, len(chain))
        if link.base_id is None or link.base_id in chain or link.base_id == current:
            break  # an anchor without a delta, or a cycle: the walk ends here
        chain.append(current)
        current = link.base_id
    if newest_full is None:
        raise MissingLink(
            f"{target_id} cannot be rebuilt: the chain back from it breaks at {current}, which is not "
            f"published{'' if held_id is None else f' and not held ({held_id} is)'}, before any full copy"
        )
    full, depth = newest_full
    return Plan(full, tuple(reversed(chain[:depth])))


# --- bytes ---------------------------------------------------------------------------------------


def encode(delta: ModelDelta) -> bytes:
    """The delta as a safetensors file (see the module docstring)."""
    header: dict = {}
    chunks: list[bytes] = []
    offset = 0
    described = {}
    for name, tensor_delta in delta.tensors.items():
        described[name] = {"shape": list(tensor_delta.shape), "dtype": str(tensor_delta.dtype)}
        for part, array in (("indices", tensor_delta.indices), ("values", tensor_delta.values)):
            data = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
            header[f"{name}:{part}"] = {
                "dtype": _SAFETENSORS_DTYPES[np.dtype(array.dtype)],
                "shape": [int(array.size)],
                "data_offsets": [offset, offset + len(data)],
            }
            chunks.append(data)
            offset += len(data)
    metadata = {"format": FORMAT, "base_id": delta.base_id, "content_id": delta.content_id}
    metadata["tensors"] = json.dumps(described, separators=(",", ":"))
    text = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(chunks)


def decode(data: bytes) -> ModelDelta:
    """An encoded delta; DeltaInvalid names what is wrong with anything else."""
    try:
        length = int.from_bytes(data[:8], "little")
        if len(data) < 8 + length:
            raise ValueError(f"the header needs {length} bytes, the data has {len(data) - 8}")
        header = json.loads(data[8 : 8 + length])
        metadata = header.pop("__metadata__")
        if metadata.get("format") != FORMAT:
            raise ValueError(f"format {metadata.get('format')!r}, not {FORMAT!r}")
        body = memoryview(data)[8 + length :]
        tensors = {}
        for name, spec in json.loads(metadata["tensors"]).items():
            parts = {}
            for part in ("indices", "values"):
                entry = header[f"{name}:{part}"]
                start, end = entry["data_offsets"]
                if not 0 <= start <= end <= len(body):
                    raise ValueError(f"{name}:{part} lies outside the data")
                dtype = np.dtype(_NUMPY_DTYPES[entry["dtype"]]).newbyteorder("<")
                parts[part] = np.frombuffer(body[start:end], dtype=dtype).astype(dtype.newbyteorder("="))
            dtype = np.dtype(spec["dtype"])
            if parts["values"].dtype != dtype or parts["indices"].dtype not in (np.uint32, np.uint64):
                raise ValueError(f"{name}: values of {parts['values'].dtype} for a {dtype} tensor")
            tensors[name] = TensorDelta(tuple(spec["shape"]), dtype, parts["indices"], parts["values"])
        return ModelDelta(metadata["base_id"], metadata["content_id"], tensors)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise DeltaInvalid(f"not an encoded weight delta ({type(exc).__name__}: {exc})") from None
