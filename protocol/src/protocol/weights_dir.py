"""The weights-directory contract: what the trainer writes and a rollout worker (or an eval job, or
a person) reads. One definition for both sides.

    <publish_dir or run_dir/checkpoints>/step_00000012/
        config.json, generation_config.json, tokenizer files
        model.safetensors, or model-0000k-of-0000N.safetensors + model.safetensors.index.json
        manifest.json        written last: a `Manifest` (the step, the content id, the files)

    or, a LoRA adapter of a base model (PEFT's layout; the manifest's `adapter` names the base):
        adapter_model.safetensors, adapter_config.json, manifest.json

Guarantees:
- The content id of a directory is the manifest's `content_id` when the manifest decodes as a
  `Manifest`; otherwise (no manifest, or one this contract does not read) a hash of config.json
  and each shard's name, size, inode and mtime, `stat-` and 16 hex digits: it changes whenever a
  shard is rewritten, and costs no read of the weights. A request's `weights_content_id` is
  compared with it, so both sides compute it here.
- A writer's content id is unique per write (`step_content_id`: `<run>-step_NNNNNNNN-<8 hex>`),
  so a worker tells two writes of one path apart; or it is the content itself
  (`files_content_id`: `sha256-` and 16 hex digits over the files' names and SHA-256s), so two
  identical builds have one id.
- Decoding checks every field's type and bounds, that file names are plain names in the directory
  (never the manifest itself, never a path), and that `bytes` is the files' total; a violation is
  a ManifestError naming the manifest and the field. Fields this contract does not know are
  ignored, so a reader keeps reading what a newer writer adds.
- Encoding writes the fields in the order above, leaving out those that are None. The trainer's
  manifests are `json.dumps(..., indent=1)` of that (as they always were); an import's are
  canonical: sorted keys, indent 2, a final newline, so the same import gives the same bytes.
- A delta publish is a step directory whose manifest names `delta_base` (the content id it
  applies to) and whose weights are one encoded delta (protocol.weights_chain), not shards.
- An adapter directory (a LoRA publish) is one whose manifest carries `adapter`: the content id
  of the base model it applies to and its rank. It holds PEFT's two files and no config.json; a
  worker serves it on the base it names (by content id), never alone.
- Step directories are `step_` and the step in at least 8 digits; `step_of` reads any number of
  digits, so the order of steps is the numbers', not the names'.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from typing import Annotated

import msgspec

from . import fsio

MANIFEST = "manifest.json"
MANIFEST_MAX_BYTES = 64 * 2**20  # a manifest lists files and checksums: kilobytes; a larger one is not a trainer's
CONFIG_MAX_BYTES = 16 * 2**20  # a model's config.json
STEP_PREFIX = "step_"
# The tokenizer's files: what a worker reads to load (or recognise) the tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
# Config and tokenizer files a serving engine reads beside the weights, copied byte for byte so a
# rollout worker recognises the same architecture and tokenizer and reloads in place.
COPIED_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES, "chat_template.jinja")

# A LoRA adapter's files, as PEFT's save_pretrained names them (and vLLM's LoRA loader reads them).
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
Hex8 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{8}$")]
Hex64 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


class ManifestError(ValueError):
    """A manifest that cannot be read as this contract's: the message names the file and the field."""


class FileEntry(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One file of the directory, as the writer wrote it."""

    size: NonNegativeInt  # bytes
    crc32c: Hex8 | None = None  # crc32c of the bytes (the trainer's writers); None: not computed
    crc32: Hex8 | None = None  # zlib's crc32: directories written before crc32c
    sha256: Hex64 | None = None  # imports: the content id is made of these


class Source(msgspec.Struct, kw_only=True):
    """What an import was made from."""

    file: str  # the source file's name (not its path: the same file gives the same manifest anywhere)
    sha256: Hex64  # of the source file


class Adapter(msgspec.Struct, kw_only=True):
    """What makes a weights directory a LoRA adapter: the base it applies to and its size."""

    base_content_id: Annotated[str, msgspec.Meta(min_length=1)]  # weights_content_id of the base model
    rank: Annotated[int, msgspec.Meta(ge=1)]  # LoRA rank r: a worker serves adapters up to its --max-lora-rank
    alpha: float  # LoRA alpha: the update is scaled by alpha / rank
    target_modules: list[str]  # the base model's modules the adapter changes ("q_proj", ...)


class Manifest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """manifest.json: the last file written into a weights directory.

    Published weights carry every field up to `created_at`; a checkpoint's manifest step, content
    id, base model and creation time; an import's content id, dtype, bytes, checksum, files,
    source and made_with."""

    step: NonNegativeInt | None = None  # the optimizer step whose weights these are (None: an import)
    content_id: Annotated[str, msgspec.Meta(min_length=1)]  # what a worker serving the directory reports
    base_model: str | None = None  # the directory the config and tokenizer files were copied from
    dtype: str | None = None  # of the tensors written, as torch names it without "torch." ("bfloat16")
    bytes: NonNegativeInt | None = None  # every file but the manifest (the sum of files' sizes)
    checksum: str | None = None  # the FileEntry field holding each file's checksum ("crc32c"); None: none
    files: dict[str, FileEntry] | None = None  # every file in the directory but the manifest (None: not listed)
    write_seconds: float | None = None  # the write up to the manifest, on the writer's clock
    created_at: float | None = None  # Unix time of the write
    source: Source | None = None  # an import's source file
    made_with: dict[str, str] | None = None  # library -> version that made an import
    # A delta publish (protocol.weights_chain): the content id of the weights its one file
    # (weights_chain.DELTA_FILE) applies to. None: the directory holds the weights whole.
    delta_base: str | None = None
    # A LoRA adapter (ADAPTER_WEIGHTS and ADAPTER_CONFIG, no config.json): the base model it applies
    # to and its rank. None: the directory holds a whole model (or a delta of one).
    adapter: Adapter | None = None

    def __post_init__(self) -> None:
        for name in self.files or {}:
            if name in ("", ".", "..", MANIFEST) or "/" in name or "\\" in name or "\0" in name:
                raise ValueError(f"files names {name!r}; it must be a file of the directory other than {MANIFEST}")
        if self.files is not None and self.bytes is not None:
            total = sum(entry.size for entry in self.files.values())
            if total != self.bytes:
                raise ValueError(f"bytes is {self.bytes}, the files listed add up to {total}")


def step_dir_name(step: int) -> str:
    """The directory name of a step's weights or checkpoint: step_00000012."""
    if step < 0:
        raise ValueError(f"a step is a non-negative number, not {step}")
    return f"{STEP_PREFIX}{step:08d}"


def step_of(name: str) -> int | None:
    """The step a directory name stands for (step_00000012 -> 12), None for any other name
    (hidden partials `.step_...partial` included)."""
    digits = name[len(STEP_PREFIX) :]
    return int(digits) if name.startswith(STEP_PREFIX) and digits.isascii() and digits.isdigit() else None


def decode_manifest(data: bytes, where: str) -> Manifest:
    """`data` as a Manifest; `where` (the file's path) names it in the error."""
    try:
        return msgspec.json.decode(data, type=Manifest)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ManifestError(
            f"{where} is not a weights manifest ({exc}); the directory was not written whole by the trainer "
            "or an import: write it again"
        ) from None


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """The manifest of `directory`. OSError when there is none (FileNotFoundError: the directory is
    incomplete or not a weights directory), ManifestError when it is not a valid one."""
    path = os.path.join(directory, MANIFEST)
    try:  # bounded, and never a FIFO (a link is followed: the caller's root check has judged its target)
        data = fsio.read_regular_file(os.path.realpath(path), MANIFEST_MAX_BYTES)
    except ValueError as exc:
        raise ManifestError(f"{exc}; the directory was not written whole by the trainer or an import") from None
    except fsio.NotRegularFile:
        raise ManifestError(f"{path} is not a regular file; write the directory again") from None
    return decode_manifest(data, path)


def encode_manifest(manifest: Manifest, *, canonical: bool = False) -> bytes:
    """The manifest's bytes: json.dumps(indent=1), or canonical (sorted keys, indent 2, final
    newline) for writers whose bytes must not depend on when they ran."""
    value = msgspec.to_builtins(manifest)
    if canonical:
        return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()
    return json.dumps(value, indent=1).encode()


def step_content_id(run_name: str, step: int) -> str:
    """A new content id for `step` of run `run_name`: unique per write, even of one step twice."""
    return f"{run_name}-{step_dir_name(step)}-{secrets.token_hex(4)}"


def files_content_id(files: dict[str, FileEntry]) -> str:
    """The id of a directory's files, made of their names and SHA-256s (the manifest excluded)."""
    digest = hashlib.sha256()
    for name in sorted(files):
        if name == MANIFEST:
            continue
        if files[name].sha256 is None:
            raise ValueError(f"{name} has no sha256; a content id made of the files needs every file's")
        digest.update(f"{name}\0{files[name].sha256}\n".encode())
    return "sha256-" + digest.hexdigest()[:16]


def safetensors_shards(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))


def declared_content_id(directory: str) -> str | None:
    """The manifest's content id, or None when there is no manifest this contract reads."""
    try:
        return read_manifest(directory).content_id
    except (OSError, ManifestError):
        return None


def weights_content_id(directory: str, shards: list[str] | tuple[str, ...] | None = None) -> str:
    """The directory's content id: the manifest's, else `stat-` and a hash of config.json and of
    each shard's name, size, inode and mtime (`shards`: the safetensors files, found when None)."""
    declared = declared_content_id(directory)
    return declared if declared is not None else stat_content_id(directory, shards)


def stat_content_id(directory: str, shards: list[str] | tuple[str, ...] | None = None) -> str:
    """The content id of a directory without a manifest this contract reads: `stat-` and a hash of
    config.json and of each shard's name, size, inode and mtime."""
    digest = hashlib.sha256()
    config = os.path.realpath(os.path.join(directory, "config.json"))
    digest.update(fsio.read_regular_file(config, CONFIG_MAX_BYTES))  # bounded, never a FIFO
    for shard in shards if shards is not None else safetensors_shards(directory):
        st = os.stat(os.path.join(directory, shard))
        digest.update(f"{shard}:{st.st_size}:{st.st_ino}:{st.st_mtime_ns}".encode())
    return "stat-" + digest.hexdigest()[:16]
