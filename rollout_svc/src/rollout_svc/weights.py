"""Weights directories: validation, content ids, and the decision to reload or rebuild.

A weights directory is an HF-format model: config.json, one or more .safetensors shards (with
model.safetensors.index.json when sharded) and tokenizer files. Only safetensors are loaded:
pickle-based formats (.bin, .pt) are refused, never opened.

Content ids are protocol.weights_dir's: the manifest's, or a hash of the files' stat data. The
manifest is read by the caller once (`declared_manifest`; rollout_svc.weight_forms decides a
directory's form from it) and handed to `weights_of`, which reads it no more.
A weight slot (protocol.weight_slots: a flat tensors file and its manifest, with the config and
tokenizer beside them) is inspected the same way and carries its manifest (`Weights.slot`);
slot_load.py loads it.
Every refusal is a RequestFailed whose message starts with the request's `weights_dir`.

Guarantees: nothing in a weights directory is opened before the allowed-root check of every
entry in it (`check_allowed`), and an entry that is not a directory or a regular file (a FIFO,
a device, a socket; links followed) is refused there, so no read of a directory someone else
wrote can block or read a device; every file is read with a size bound.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from protocol.fsio import read_regular_file
from protocol.messages import ErrorCode
from protocol.weight_slots import SlotError, SlotManifest, is_slot, read_slot_manifest
from protocol.weights_dir import Manifest, ManifestError, read_manifest, stat_content_id

from .errors import RequestFailed

# config.json keys that fix the shapes of the engine's tensors: a change needs a new engine.
ARCHITECTURE_KEYS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
    "torch_dtype",
    "dtype",
)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# Bounds on the files of a weights directory read whole (the shards are read by the engine).
MAX_CONFIG_BYTES = 16 * 2**20  # config.json, tokenizer_config.json, a safetensors index
MAX_TOKENIZER_BYTES = 256 * 2**20  # tokenizer.json and the other tokenizer files
MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header


@dataclass(frozen=True)
class Weights:
    """A validated weights directory."""

    path: str  # as the request named it
    real_path: str  # symlinks resolved
    content_id: str
    config: dict
    shards: tuple[str, ...]  # safetensors file names
    size_bytes: int  # the shards' total size (a slot's: its tensors' bytes): what loading these weights reads
    slot: SlotManifest | None = None  # a weight slot's manifest, as inspected; None: a weights directory

    @property
    def architecture(self) -> dict:
        return {k: self.config.get(k) for k in ARCHITECTURE_KEYS}


class WeightsPolicy:
    """Where weights may come from. With no roots, any readable directory is allowed.

    With roots, the directory and every file and directory in it must resolve inside them: a
    shard, config or tokenizer file that is a symlink to a file outside is refused like a
    directory outside, before anything reads it (the engines read only what is in the
    directory)."""

    def __init__(self, allowed_roots: list[str] | None = None):
        self.allowed_roots = [os.path.realpath(r) for r in (allowed_roots or [])]

    def _inside(self, real: str) -> bool:
        return any(real == r or real.startswith(r.rstrip("/") + "/") for r in self.allowed_roots)

    def check_allowed(self, weights_dir: str) -> str:
        """The resolved path of `weights_dir`, once it and (for a directory) every entry in it are
        inside the roots and every file in it is a regular one (check_files_allowed): call it
        before anything reads a file of the directory, its manifest included."""
        real = self._check_root(weights_dir)
        if os.path.isdir(real):
            self.check_files_allowed(real, weights_dir)
        return real

    def check_allowed_dir(self, weights_dir: str) -> str:
        """check_allowed for what must be a directory: WEIGHTS_NOT_FOUND when it is not one."""
        real = self._check_root(weights_dir)
        if not os.path.isdir(real):
            raise RequestFailed(
                ErrorCode.WEIGHTS_NOT_FOUND,
                f"weights_dir {weights_dir} does not exist or is not a directory; name a saved model directory",
            )
        self.check_files_allowed(real, weights_dir)
        return real

    def _check_root(self, weights_dir: str) -> str:
        real = os.path.realpath(weights_dir)
        if self.allowed_roots and not self._inside(real):
            raise RequestFailed(
                ErrorCode.WEIGHTS_NOT_ALLOWED,
                f"weights_dir {weights_dir} (resolved: {real}) is outside the allowed roots "
                f"{', '.join(self.allowed_roots)}; move the checkpoint under one of them or start "
                "the worker with another --allowed-root",
            )
        return real

    def check_files_allowed(self, real: str, weights_dir: str) -> None:
        """Every entry under the directory `real` (symlinks resolved) lies inside the roots, and each
        file is a regular file: a FIFO would block its reader forever, a link to /dev/zero feed it
        until memory runs out. Only metadata is looked at (stat never opens a file)."""
        for directory, subdirs, files in os.walk(real):  # symlinked directories are checked, not entered
            for name in [*subdirs, *files]:
                path = os.path.join(directory, name)
                inner = os.path.relpath(path, real)
                target = os.path.realpath(path)
                if self.allowed_roots and not self._inside(target):
                    raise RequestFailed(
                        ErrorCode.WEIGHTS_NOT_ALLOWED,
                        f"weights_dir {weights_dir}: {inner} resolves to {target}, outside the allowed roots "
                        f"{', '.join(self.allowed_roots)}; copy the file into the checkpoint instead of linking "
                        "it, or start the worker with another --allowed-root",
                    )
                if name in files:
                    _check_regular(path, inner, weights_dir)

    def inspect(self, weights_dir: str) -> Weights:
        """Validate a weights directory without loading tensors. Raises RequestFailed."""
        real = self.check_allowed_dir(weights_dir)
        return weights_of(real, weights_dir, declared_manifest(real))


def declared_manifest(real: str) -> Manifest | None:
    """The manifest of the checked directory `real` (bounded, never a FIFO: protocol's read_manifest),
    None when it has none this contract reads: its content id is then the files' stats."""
    try:
        return read_manifest(real)
    except (OSError, ManifestError):
        return None


def weights_of(real: str, shown: str, manifest: Manifest | None) -> Weights:
    """The weights directory `real` (checked by WeightsPolicy.check_allowed_dir; `manifest` its
    declared_manifest, read once by the caller) validated without loading tensors, as `shown`.
    Raises RequestFailed."""
    config = _read_config(real, shown)
    if is_slot(real):
        slot = _slot_manifest(real, shown)
        return Weights(shown, real, slot.content_id, config, (), slot.bytes, slot)
    shards = _shards(real, shown)
    size_bytes = sum(check_safetensors_header(Path(real) / shard, shown) for shard in shards)
    content_id = manifest.content_id if manifest is not None else stat_content_id(real, shards)
    return Weights(shown, real, content_id, config, tuple(shards), size_bytes)


def _slot_manifest(real: str, shown: str) -> SlotManifest:
    """The manifest of the slot `real`; a refusal naming `shown` when it has none or a bad one."""
    try:
        return read_slot_manifest(real)
    except FileNotFoundError:
        raise RequestFailed(
            ErrorCode.WEIGHTS_NOT_FOUND,
            f"weights_dir {shown} is a weight slot without complete weights now (being written, or retired): "
            "name the newest published weights",
        ) from None
    except (OSError, SlotError) as exc:
        raise RequestFailed(ErrorCode.WEIGHTS_INVALID, f"weights_dir {shown}: {exc}") from None


def _check_regular(path: str, inner: str, shown: str) -> None:
    try:
        mode = os.stat(path).st_mode  # links followed: what a reader would open
    except FileNotFoundError:
        return  # a dangling link, or removed since the listing: the read that needs it says so
    if not stat.S_ISREG(mode):
        device = stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if device else "a socket"
        raise RequestFailed(
            ErrorCode.WEIGHTS_INVALID,
            f"weights_dir {shown}: {inner} is {kind}, not a regular file; a weights directory holds only "
            "regular files: remove it, or publish the weights again",
        )


def read_weights_file(path: str | os.PathLike, max_bytes: int) -> bytes:
    """A file of a checked weights directory, its links resolved (a Hugging Face cache's snapshot
    links into its blobs; the roots were checked on the resolved path), read without blocking and
    at most `max_bytes` (protocol.fsio.read_regular_file). OSError or ValueError otherwise."""
    return read_regular_file(os.path.realpath(path), max_bytes)


def _read_config(real: str, shown: str) -> dict:
    path = os.path.join(real, "config.json")
    try:
        config = json.loads(read_weights_file(path, MAX_CONFIG_BYTES))
    except FileNotFoundError:
        raise RequestFailed(
            ErrorCode.WEIGHTS_INVALID, f"weights_dir {shown} has no config.json; save the model with save_pretrained"
        ) from None
    except (OSError, ValueError) as exc:
        raise RequestFailed(
            ErrorCode.WEIGHTS_INVALID, f"weights_dir {shown}: config.json is unreadable ({exc}); save the model again"
        ) from None
    if not isinstance(config, dict):
        raise RequestFailed(
            ErrorCode.WEIGHTS_INVALID, f"weights_dir {shown}: config.json is not a JSON object; save the model again"
        )
    return config


def _shards(real: str, shown: str) -> list[str]:
    names = sorted(os.listdir(real))
    index = os.path.join(real, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            shard_names = json.loads(read_weights_file(index, MAX_CONFIG_BYTES))["weight_map"].values()
            if not all(isinstance(name, str) for name in shard_names):
                raise ValueError("weight_map values must be shard file names")
            wanted = sorted(set(shard_names))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RequestFailed(
                ErrorCode.WEIGHTS_INVALID,
                f"weights_dir {shown}: model.safetensors.index.json is unreadable ({exc}); save the model again",
            ) from None
        missing = [s for s in wanted if s not in names]
        if missing:
            raise RequestFailed(
                ErrorCode.WEIGHTS_INVALID,
                f"weights_dir {shown} lacks shards named in its index: {', '.join(missing[:5])}; copy them too",
            )
        return wanted
    shards = [n for n in names if n.endswith(".safetensors")]
    if not shards:
        pickled = [n for n in names if n.endswith(_PICKLE_SUFFIXES)]
        hint = (
            f" It holds {', '.join(pickled[:3])}: pickle formats are never loaded; convert them with "
            "save_pretrained(..., safe_serialization=True)."
            if pickled
            else " Save the model with save_pretrained(..., safe_serialization=True)."
        )
        raise RequestFailed(ErrorCode.WEIGHTS_INVALID, f"weights_dir {shown} has no .safetensors weights.{hint}")
    return shards


def check_safetensors_header(path: Path, shown: str) -> int:
    """A shard is corrupt when its header is unreadable or its tensors run past the end of
    the file (a truncated copy). Reads only the header, not the tensors; returns the file's size."""
    try:
        fd = os.open(os.path.realpath(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("not a regular file")
            size = st.st_size
            header_len = int.from_bytes(os.pread(fd, 8, 0), "little")
            if header_len <= 0 or 8 + header_len > size or header_len > MAX_HEADER_BYTES:
                raise ValueError("header length out of range")
            header = json.loads(os.pread(fd, header_len, 8))
        finally:
            os.close(fd)
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        if 8 + header_len + end > size:
            raise ValueError(f"tensors need {8 + header_len + end} bytes, the file has {size}")
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise RequestFailed(
            ErrorCode.WEIGHTS_INVALID,
            f"weights_dir {shown}: {path.name} is not a valid safetensors file ({exc}); copy it again",
        ) from None
    return size


def check_tokenizer_fits(weights: Weights, tokenizer_size: int) -> None:
    """The tokenizer must not produce ids beyond the model's embedding table."""
    vocab = weights.config.get("vocab_size")
    if isinstance(vocab, int) and tokenizer_size > vocab:
        raise RequestFailed(
            ErrorCode.WEIGHTS_INVALID,
            f"weights_dir {weights.path}: the tokenizer has {tokenizer_size} tokens but the model's vocab_size is "
            f"{vocab}; ids past {vocab - 1} cannot be served. Save the tokenizer that belongs to these weights",
        )
