"""LoRA adapters a worker serves on the model it loaded: recognised, checked, copied, cached.

A weights directory is an adapter when its manifest carries `adapter` (protocol.weights_dir:
PEFT's adapter_model.safetensors and adapter_config.json, the base's content id and the rank).

    adapters = Adapters(max_rank=16, keep=8)
    form = weight_forms.resolve(policy, weights_dir)          # an AdapterWeights: its manifest names a base
    adapter = adapters.prepare(form, expected_content_id)     # an AdapterRef for the engine
    adapters.close()                                          # the copies go

Guarantees:
- Checked before the engine sees it, the roots first (before its cached copy answers): inside the
  allowed roots (every file, each a regular one: weight_forms.resolve, for each request), the rank
  within the worker's --max-lora-rank, the request's `weights_content_id` the manifest's, the files those the
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
from protocol.weights_dir import ADAPTER_CONFIG, ADAPTER_WEIGHTS, Manifest

from .errors import RequestFailed, require_content_id
from .scratch import own_dir
from .weight_forms import AdapterWeights
from .weights import check_safetensors_header, declared_manifest

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


class Adapters:
    def __init__(self, max_rank: int, keep: int):
        self.max_rank = max_rank  # 0: the worker serves no adapters
        self.keep = max(1, keep)
        self.ids = itertools.count(1)
        self.held: OrderedDict[str, AdapterRef] = OrderedDict()  # content id -> copy, least recent first
        self.root: str | None = None

    def prepare(self, form: AdapterWeights, expected_content_id: str | None) -> AdapterRef:
        """The engine's reference to the adapter `form` (resolved by rollout_svc.weight_forms for
        this request, so its directory passed the allowed-root check just now: a copy made for a
        directory once allowed answers only after that)."""
        weights_dir, real, manifest = form.path, form.real_path, form.manifest
        adapter = manifest.adapter
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
            now = declared_manifest(real)  # still the version checked: else republished or pruned meanwhile
            if now is not None and now.adapter is None:
                now = None
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
