"""LoRA adapters a worker serves on the model it loaded: recognised, checked, copied, cached.

A weights directory is an adapter when its manifest carries `adapter` (protocol.weights_dir:
PEFT's adapter_model.safetensors and adapter_config.json, the base's content id and the rank).

    adapters = Adapters(policy, max_rank=16, keep=8)
    manifest = adapter_manifest(weights_dir)                  # None: not an adapter
    adapter = adapters.prepare(weights_dir, manifest, expected_content_id)   # an AdapterRef for the engine
    adapters.close()                                          # the copies go

Guarantees:
- Checked before the engine sees it, the roots first (before its cached copy answers): inside the
  allowed roots (every file, each a regular one), the rank within the
  worker's --max-lora-rank, the request's `weights_content_id` the manifest's, the files those the
  manifest lists with their sizes, the safetensors header whole. A refusal is a RequestFailed
  naming the directory, the problem and what to do (`adapter_refused` for what this worker
  cannot serve, `weights_*` for a directory that is not right).
- The engine reads a copy of the worker's own, made once per content id, and taken only when the
  manifest read after the copy still names the same content id: a directory republished or pruned
  after the check cannot reach the engine half old, half new, or vanish before vLLM reads it
  (vLLM reads an adapter's files when it first serves it, and again after evicting it).
- One vLLM id per content id, so vLLM's cache never serves another version under an old id;
  copies beyond the newest `keep` are removed (an evicted adapter asked for again is copied again),
  all of them at close, and those of a worker that died (SIGKILL) by the next worker's first copy.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from protocol.messages import ErrorCode
from protocol.weights_dir import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST, Manifest, decode_manifest

from .errors import RequestFailed, require_content_id
from .scratch import own_dir
from .weights import MAX_CONFIG_BYTES, WeightsPolicy, check_safetensors_header, read_weights_file

COPY_TRIES = 3  # copies of a directory replaced under each of them, before its request fails
_ROOT_PREFIX = "rollout-adapters-"  # + pid + "-" + random: the copies of one worker process


@dataclass(frozen=True)
class AdapterRef:
    """A LoRA adapter the engine serves: vLLM's id for it, and the worker's copy of its files."""

    lora_id: int  # vLLM's cache key: one per content id
    content_id: str
    path: str  # the worker's verified copy (rollout_svc.adapters)


def _own_root() -> str:
    """A directory of this process in the temporary directory, for its copies."""
    return str(own_dir(Path(tempfile.gettempdir()), _ROOT_PREFIX))


def adapter_manifest(weights_dir: str) -> Manifest | None:
    """The manifest of `weights_dir` when it is an adapter directory; None otherwise (a model, a
    slot, a directory without a manifest, or one that is not a regular file or too large: the
    ordinary weights path inspects and refuses those). Call it once the directory passed
    WeightsPolicy.check_allowed: it reads the manifest."""
    path = os.path.join(weights_dir, MANIFEST)
    try:
        manifest = decode_manifest(read_weights_file(path, MAX_CONFIG_BYTES), path)
    except (OSError, ValueError):  # ManifestError is a ValueError
        return None
    return manifest if manifest.adapter is not None else None


class Adapters:
    def __init__(self, policy: WeightsPolicy, max_rank: int, keep: int):
        self.policy = policy
        self.max_rank = max_rank  # 0: the worker serves no adapters
        self.keep = max(1, keep)
        self.ids = itertools.count(1)
        self.held: OrderedDict[str, AdapterRef] = OrderedDict()  # content id -> copy, least recent first
        self.root: str | None = None

    def prepare(self, weights_dir: str, manifest: Manifest, expected_content_id: str | None) -> AdapterRef:
        """The engine's reference to the adapter `weights_dir` (whose manifest is `manifest`)."""
        adapter = manifest.adapter
        # Before anything answers, the cache included: a copy made for a directory once allowed
        # says nothing about what this request's path resolves to now.
        real = self.policy.check_allowed(weights_dir)
        if not self.max_rank:
            raise RequestFailed(
                ErrorCode.ADAPTER_REFUSED,
                f"weights_dir {weights_dir} is a LoRA adapter (rank {adapter.rank}) and this worker was started "
                f"without LoRA; start it with --max-lora-rank {adapter.rank} (or more), or name full weights",
            )
        if adapter.rank > self.max_rank:
            raise RequestFailed(
                ErrorCode.ADAPTER_REFUSED,
                f"weights_dir {weights_dir} is a LoRA adapter of rank {adapter.rank}, above this worker's "
                f"--max-lora-rank {self.max_rank}; restart the worker with --max-lora-rank {adapter.rank} (or more), "
                "or train a smaller rank",
            )
        require_content_id(weights_dir, manifest.content_id, expected_content_id)
        found = self.held.get(manifest.content_id)
        if found is not None:
            self.held.move_to_end(manifest.content_id)
            return found
        for _ in range(COPY_TRIES):
            copy = self._copy(real, weights_dir, manifest)
            now = adapter_manifest(real)
            if now is not None and now.content_id == manifest.content_id:
                return self._hold(AdapterRef(next(self.ids), manifest.content_id, copy))
            shutil.rmtree(copy, ignore_errors=True)
            if now is None or (expected_content_id is not None and now.content_id != expected_content_id):
                raise RequestFailed(
                    ErrorCode.WEIGHTS_NOT_FOUND,
                    f"weights_dir {weights_dir} was removed or replaced while it was read; name the newest "
                    "published weights",
                )
            manifest = now
        raise RequestFailed(
            ErrorCode.WEIGHTS_INVALID,
            f"weights_dir {weights_dir} was replaced each of the {COPY_TRIES} times it was read; publish each "
            "version into a new directory",
        )

    def _copy(self, real: str, shown: str, manifest: Manifest) -> str:
        """The adapter's two files copied into a directory of the worker's own, checked against the
        manifest's sizes and the safetensors header."""
        if self.root is None:
            self.root = _own_root()
        copy = tempfile.mkdtemp(dir=self.root)
        listed = manifest.files or {}
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
            try:
                shutil.copyfile(os.path.join(real, name), os.path.join(copy, name))
            except FileNotFoundError:
                shutil.rmtree(copy, ignore_errors=True)
                raise RequestFailed(
                    ErrorCode.WEIGHTS_INVALID,
                    f"weights_dir {shown} is a LoRA adapter without {name}; publish it again (PEFT's "
                    f"save_pretrained writes {ADAPTER_WEIGHTS} and {ADAPTER_CONFIG})",
                ) from None
            size = os.path.getsize(os.path.join(copy, name))
            if name in listed and listed[name].size != size:
                shutil.rmtree(copy, ignore_errors=True)
                raise RequestFailed(
                    ErrorCode.WEIGHTS_INVALID,
                    f"weights_dir {shown}: {name} has {size} bytes, its manifest says {listed[name].size}; "
                    "publish it again",
                )
        try:
            check_safetensors_header(Path(copy) / ADAPTER_WEIGHTS, shown)
        except RequestFailed:
            shutil.rmtree(copy, ignore_errors=True)
            raise
        return copy

    def _hold(self, ref: AdapterRef) -> AdapterRef:
        self.held[ref.content_id] = ref
        while len(self.held) > self.keep:
            _, old = self.held.popitem(last=False)
            shutil.rmtree(old.path, ignore_errors=True)
        return ref

    def close(self) -> None:
        self.held.clear()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
