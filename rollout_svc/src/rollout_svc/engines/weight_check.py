"""The check of an engine's live weights against the files they were loaded from: which row blocks
of which tensors are summed (the largest tensors both hold, PROBE_BLOCKS blocks each, spread from
the first rows to the last), the files' sums, and their comparison with the engine's.

A reload that failed or was skipped leaves whole tensors stale, which any block shows; summing
blocks instead of whole tensors keeps the check in milliseconds at billions of parameters (whole
tensors cost 0.5 s at 1.5B). Sums are float64 over values cast to the engine's dtype, so the files'
and the engine's agree to PROBE_RTOL when the weights are the same; anything else is StaleWeights.
"""

from __future__ import annotations

import logging
import math
import os

from ..weights import Weights

log = logging.getLogger("rollout_svc.engines.weight_check")

PROBED_TENSORS = 6  # largest comparable tensors checked after each weight change
PROBE_BLOCKS = 4  # row blocks of each, spread from its first rows to its last
PROBE_BLOCK_ELEMENTS = 1 << 18  # so a check reads ~6 M values, not the weights (a 1.5B model's embedding: 233 M)
PROBE_RTOL = 1e-5


class StaleWeights(RuntimeError):
    """The engine's tensors differ from the files after a weight change."""


def plan(weights: Weights, engine_shapes: dict[str, list[int]]):
    """The source of `weights`' tensors, and the row blocks of its largest tensors that the engine
    also holds (`engine_shapes`: the engine's parameters' shapes)."""
    source = SlotSource(weights) if weights.slot is not None else ShardSource(weights)
    candidates = [(math.prod(shape), name, shape) for name, shape in source.shapes() if name in engine_shapes]
    blocks = {name: probe_blocks(shape) for _, name, shape in sorted(candidates, reverse=True)[:PROBED_TENSORS]}
    return source, blocks


def file_sums(source, blocks: dict, dtype) -> dict[str, float]:
    """The float64 sum of each tensor's `blocks` in `source`, its values cast to the engine's `dtype`."""
    dtype = torch_dtype(dtype)
    return {
        name: sum(float(source.rows(name, a, b).to(dtype).double().sum()) for a, b in name_blocks)
        for name, name_blocks in blocks.items()
    }


def compare(weights: Weights, expected: dict[str, float], actual: dict[str, float]) -> None:
    """StaleWeights unless the engine's sums (`actual`) equal the files' (`expected`)."""
    if not expected:
        log.warning("no tensor of %s can be compared with the engine's; weights not verified", weights.path)
    for name, want in expected.items():
        got = actual.get(name)
        if got is None or not math.isclose(got, want, rel_tol=PROBE_RTOL, abs_tol=PROBE_RTOL):
            raise StaleWeights(f"{name}: engine sum {got}, file sum {want}")


class ShardSource:
    """A weights directory's tensors, for _verify: names and shapes, and row blocks read on demand."""

    def __init__(self, weights: Weights):
        self.weights = weights
        self.shard_of: dict[str, str] = {}

    def shapes(self):
        from safetensors import safe_open

        for shard in self.weights.shards:
            with safe_open(os.path.join(self.weights.real_path, shard), framework="pt") as f:
                for name in f.keys():
                    self.shard_of[name] = shard
                    yield name, f.get_slice(name).get_shape()

    def rows(self, name: str, start: int, stop: int):
        from safetensors import safe_open

        with safe_open(os.path.join(self.weights.real_path, self.shard_of[name]), framework="pt") as f:
            return f.get_slice(name)[start:stop]

    def close(self) -> None:
        pass


class SlotSource:
    """A weight slot's tensors, for _verify: its manifest's names and shapes, row blocks read from a
    mapping of tensors.bin (the reader's lease is held around every load, so the bytes are those
    loaded)."""

    def __init__(self, weights: Weights):
        from ..slot_load import MappedSlot

        self.manifest = weights.slot
        self.slot = MappedSlot(weights.real_path, pin=False)

    def shapes(self):
        return ((name, entry.shape) for name, entry in self.manifest.tensors.items())

    def rows(self, name: str, start: int, stop: int):
        import torch

        entry = self.manifest.tensors[name]
        tensor = self.slot.view[entry.offset : entry.offset + entry.nbytes].view(getattr(torch, entry.dtype))
        return tensor.view(entry.shape)[start:stop]

    def close(self) -> None:
        self.slot.close()


def probe_blocks(shape: list[int]) -> list[tuple[int, int]]:
    """[start, stop) row ranges of a tensor of `shape` that a check sums: PROBE_BLOCKS blocks of
    up to PROBE_BLOCK_ELEMENTS values, the first at row 0 and the last ending at the last row."""
    rows = shape[0] if shape else 1
    per_row = math.prod(shape[1:]) if len(shape) > 1 else 1
    take = max(1, min(rows, PROBE_BLOCK_ELEMENTS // max(per_row, 1)))
    if take * PROBE_BLOCKS >= rows:
        return [(0, rows)]
    last = rows - take
    starts = sorted({round(i * last / (PROBE_BLOCKS - 1)) for i in range(PROBE_BLOCKS)})
    return [(start, start + take) for start in starts]


def torch_dtype(dtype):
    """vLLM's model dtype (a torch.dtype) or a name of one."""
    import torch

    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
