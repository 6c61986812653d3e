"""Publishing weights as sparse deltas: a step directory holding only the elements that changed.

A delta publish is a step directory as protocol.weights_chain describes it: the config and
tokenizer files, one encoded delta (protocol.weight_delta) against the previous publish, and a
manifest (written last, renamed into place like every publish) whose `delta_base` is the content
id the delta applies to. A rollout worker rebuilds it from the chain (rollout_svc.delta_load).

Guarantees:
- What is diffed is what was published: each tensor cast to the serving dtype once (on its
  device), in host memory, never the float32 master weights; the publisher keeps the last
  publish's tensors (one copy of the model in the serving dtype, on rank 0) and diffs the next
  against them, so the anchor and the deltas after it rebuild each publish bit for bit. A full
  publish writes those same host tensors. Host tensors already in the serving dtype are read
  where they are (no copy).
- At most `anchor_every - 1` deltas follow a full publish (the anchor), so a worker that holds
  nothing reads at most that many deltas after one full directory.
- A delta is published only when it is smaller than `DELTA_PAYS` of the full weights (a 4-byte
  index and the new value per changed element); otherwise the publish is full: a new anchor.
- The first publish of a process is full (nothing is held to diff against: a resume, a restart).
- Atomic and durable like every publish (atomic_dir, fsync of each file and of the directory).

Every rank calls publish with the same stream (under FSDP2 each tensor is a gather); rank 0 keeps
the copies and writes, the others get None.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from protocol import weight_delta
from protocol.weights_chain import DELTA_FILE
from protocol.weights_dir import STEP_PREFIX, step_content_id

from ..distributed import Begun, Distributed
from . import publish as published
from .atomic_dir import building, remove_stale_partials
from .streaming import write_small
from .writer import TensorStream, as_stream, finish_published

log = logging.getLogger(__name__)

_UNNAMED = "(not yet published)"
DELTA_PAYS = 0.5  # a delta is published when its bytes are under this fraction of the full weights'


@dataclass(frozen=True)
class PublishStats:
    """One publish as the delta publisher saw it."""

    step: int
    kind: str  # "full" or "delta"
    reason: str  # why that kind
    elements: int  # of all tensors
    changed: int | None  # elements whose bits differ from the previous publish (None: nothing to diff)
    delta_bytes: int | None  # the encoded delta (None: not diffed)
    full_bytes: int  # the tensors in the serving dtype
    written_bytes: int  # the directory's files
    copy_s: float  # cast and copy to host memory
    diff_s: float  # diff and encode
    write_s: float  # the directory written

    @property
    def changed_fraction(self) -> float | None:
        return None if self.changed is None else self.changed / max(self.elements, 1)


class DeltaWriter:
    def __init__(self, anchor_every: int):
        if anchor_every < 1:
            raise ValueError(f"publish.delta_anchor_every must be at least 1, not {anchor_every}")
        self.anchor_every = anchor_every
        self.held: dict[str, torch.Tensor] | None = None  # the last publish's tensors (host, serving dtype)
        self.held_id: str | None = None  # its content id
        # The publish before it: host buffers the next publish copies into (copying into memory
        # already touched is 3-4x faster than into new pages: 0.19 s against 0.7 s for 270 MB).
        self.spare: dict[str, torch.Tensor] | None = None
        self.since_anchor = 0  # deltas published since the last full publish
        self.last: PublishStats | None = None

    def forget(self) -> None:
        """Drop what is held: the next publish is full (after a resume, or weights put back)."""
        self.held, self.held_id, self.spare, self.since_anchor = None, None, None, 0

    def publish(
        self, step: int, tensors, *, dist_info: Distributed | None = None, **options
    ) -> published.Published | None:
        """Publish `tensors` as step `step` (`begin` says how). Returns the record on rank 0, None
        elsewhere."""
        return self.begin(step, tensors, dist_info=dist_info, **options).finish_on_rank0(
            dist_info, f"publish step {step}"
        )

    def begin(
        self,
        step: int,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | TensorStream,
        *,
        publish_dir: Path,
        base_model: Path,
        dist_info: Distributed | None = None,
        run_name: str | None = None,
        dtype: torch.dtype | None = None,
    ) -> Begun[published.Published]:
        """The publish of `tensors` as step `step`, for rank 0 to finish: a delta against the
        previous publish when it pays, else whole. Every rank consumes the stream here (under
        FSDP2 its gathers); rank 0 keeps the tensors and diffs and writes them when finished."""
        started = time.monotonic()
        main = dist_info is None or dist_info.is_main
        current, borrowed = _host_tensors(as_stream(tensors), dtype, keep=main, into=self.spare)
        return Begun(
            lambda: self._publish(
                step, current, borrowed, started, Path(publish_dir), Path(base_model), run_name, dtype
            ),
            agree=dist_info is not None and dist_info.world_size > 1,
        )

    def _publish(
        self, step, current, borrowed, started, publish_dir, base_model, run_name, dtype
    ) -> published.Published:
        copied = time.monotonic()
        elements = sum(t.numel() for t in current.values())
        full_bytes = sum(t.numel() * t.element_size() for t in current.values())
        delta, reason, diff_s = None, "", 0.0
        if self.held is None:
            reason = "nothing held to diff against"
        elif self.since_anchor + 1 >= self.anchor_every:
            reason = f"anchor (every {self.anchor_every} publishes)"
        else:
            try:
                delta = weight_delta.diff_model(
                    _bits(self.held), _bits(current), base_id=self.held_id, content_id=_UNNAMED
                )  # named when written: its content id is made with the directory
            except weight_delta.DeltaInvalid as exc:  # the tensors changed name, shape or dtype
                reason = str(exc)
            diff_s = time.monotonic() - copied
            if delta is not None and delta.nbytes >= DELTA_PAYS * full_bytes:
                reason = f"a delta would be {delta.nbytes / full_bytes:.0%} of the full weights"
        changed = None if delta is None else delta.changed
        delta_bytes = None if delta is None else delta.nbytes
        if delta is not None and not reason:
            record = self._write_delta(step, delta, publish_dir, base_model, run_name, dtype, current, started)
            kind, reason = "delta", f"against {self.held_id}"
            self.since_anchor += 1
        else:
            record = published.publish(
                step, current, publish_dir=publish_dir, base_model=base_model, run_name=run_name, dtype=dtype
            )
            kind = "full"
            self.since_anchor = 0
        if kind == "delta":  # the copy held becomes this publish: the changed elements written into it
            held = _bits(self.held)
            for name, tensor_delta in delta.tensors.items():
                weight_delta.apply(held[name], tensor_delta)
            self.spare = {name: t for name, t in current.items() if name not in borrowed} or self.spare
        else:  # the tensors published, owned: a borrowed one (the caller's own) is copied first
            for name in borrowed:
                target = (self.held or {}).get(name)
                if target is not None and target.shape == current[name].shape and target.dtype == current[name].dtype:
                    target.copy_(current[name])
                    current[name] = target
                else:
                    current[name] = current[name].clone()
            self.spare, self.held = None if borrowed else self.held, current
        self.held_id = record.content_id
        self.last = PublishStats(
            step=step,
            kind=kind,
            reason=reason,
            elements=elements,
            changed=changed,
            delta_bytes=delta_bytes,
            full_bytes=full_bytes,
            written_bytes=record.bytes,
            copy_s=copied - started,
            diff_s=diff_s,
            write_s=record.seconds,
        )
        log.info(
            "published step %d %s (%s): %s changed, %d bytes written, full weights %d bytes",
            step, kind, reason, "-" if changed is None else f"{changed / max(elements, 1):.2%}", record.bytes,
            full_bytes,
        )  # fmt: skip
        return record

    def _write_delta(self, step, delta, publish_dir, base_model, run_name, dtype, current, started):
        """The delta as publish_dir/step_NNNNNNNN (manifest last, renamed into place)."""
        write_started = time.monotonic()
        publish_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(publish_dir, STEP_PREFIX)
        content_id = step_content_id(run_name or publish_dir.absolute().parent.name, step)
        delta = weight_delta.ModelDelta(delta.base_id, content_id, delta.tensors)
        if not (base_model / "config.json").is_file():
            raise FileNotFoundError(f"{base_model} has no config.json: name the base model directory to copy it from")
        dest = published.published_dir(publish_dir, step)
        with building(dest, files_synced=True) as staging:  # each file fsynced as written
            files = {DELTA_FILE: write_small(staging / DELTA_FILE, weight_delta.encode(delta))}
            written_dtype = dtype or next(iter(current.values())).dtype
            total = finish_published(
                staging, files, base_model, step, content_id, written_dtype, "crc32c", started, delta.base_id
            )
        return published.Published(dest, step, content_id, total, time.monotonic() - write_started)


def _host_tensors(
    stream: TensorStream, dtype: torch.dtype | None, *, keep: bool, into: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Each tensor of the stream cast to `dtype` where it lives (the cast a full publish makes),
    in host memory, contiguous; and the names of those that are the caller's own tensors,
    borrowed (a host tensor already in `dtype`: read, never copied, never kept past the publish).
    Others are copied into the tensor of `into` of their name where it fits (overwritten: memory
    already touched takes a copy 3-4x faster than new pages). Every rank consumes the stream,
    `keep` ones keep the tensors."""
    tensors, borrowed = {}, set()
    for name, tensor in stream:
        with torch.no_grad():
            cast = tensor.detach().to(dtype) if dtype is not None else tensor.detach()
            if keep and cast.device.type == "cpu" and cast.is_contiguous():
                tensors[name] = cast  # the cast's own result, or the caller's tensor (borrowed)
                if cast.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
                    borrowed.add(name)
            elif keep:
                host = (into or {}).get(name)
                if host is not None and host.shape == cast.shape and host.dtype == cast.dtype:
                    host.copy_(cast)
                else:
                    host = cast.to("cpu", copy=True).contiguous()
                tensors[name] = host
        del tensor, cast
    return tensors, borrowed


def _bits(tensors: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The tensors' elements as numpy unsigned integers of their width (views, no copies)."""
    out = {}
    for name, tensor in tensors.items():
        flat = tensor.reshape(-1).view(torch.uint8).numpy()
        out[name] = flat.view(np.dtype(f"<u{tensor.element_size()}")).reshape(tuple(tensor.shape))
    return out
