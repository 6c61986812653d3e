"""A GGUF model file (llama.cpp's format) made into the Hugging Face directory the trainer trains
(`model.path`) and rollout workers serve.

    trainer-svc import-gguf MODEL.gguf OUT_DIR [--dtype bfloat16] [--expect PIN.json]

OUT_DIR is an HF directory: config.json without quantization (the weights are dequantized), a
generation config whose eos_token_id is the token that ends an assistant turn in the chat
template, model.safetensors in `dtype` (tied duplicates left out, as save_pretrained does), the
tokenizer files with the chat template, and manifest.json last (canonical JSON: content id, each
file's size, crc32c and sha256, the source file, the library versions that made it).

transformers reads the file (`from_pretrained(..., gguf_file=...)`, which needs the `gguf` and
`accelerate` packages: `pip install 'trainer_svc[gguf]'`); so every architecture and quantization
transformers reads is imported, dequantized into dense tensors.

Guarantees:
- Deterministic: the same file, with the same versions of transformers, tokenizers, gguf and torch,
  gives the same bytes in every file (JSON with sorted keys and no timestamps or versions, tensors
  in safetensors' order by name, no creation times).
- The content id is `sha256-` and 16 hex digits of a SHA-256 over the other files' names and
  SHA-256s (protocol.weights_dir.files_content_id). It is the manifest's `content_id`, which
  protocol.weights_dir reads: what a worker serving the directory reports, and what a request may
  demand.
- Atomic (atomic_dir): written in a hidden sibling and renamed into place, replacing any previous
  OUT_DIR whole. With a pin (`expect`), the new directory is put in place only when its content
  id equals the pin's; otherwise nothing changes and ImportMismatch names the files that differ,
  the source file's hash and the library versions against the pin's.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path

from protocol import exit_codes
from protocol.fsio import write_synced
from protocol.weights_dir import (
    MANIFEST,
    FileEntry,
    Manifest,
    Source,
    encode_manifest,
    files_content_id,
    read_manifest,
    weights_content_id,
)

from .atomic_dir import building

WEIGHTS_FILE = "model.safetensors"
DTYPES = ("bfloat16", "float16", "float32")
# The library versions recorded in the manifest and compared with a pin's: the bytes written
# depend on them (transformers maps and dequantizes, tokenizers serialises, torch casts).
LIBRARIES = ("transformers", "tokenizers", "gguf", "torch", "safetensors")
# Written into an assistant turn to find, in the rendered text, what the template puts after it.
_PROBE = "\u2063turn\u2063"
_CHUNK = 16 * 2**20


class ImportFailed(ValueError):
    """The file cannot be imported (missing packages, not a GGUF file, an unknown dtype)."""

    exit_code = exit_codes.USAGE


class ImportMismatch(ValueError):
    """The import differs from its pin; the message says what differs."""

    exit_code = exit_codes.INTERNAL_ERROR


@dataclass(frozen=True)
class Imported:
    path: Path
    content_id: str
    parameters: int  # in the weights file (tied duplicates counted once)
    bytes: int  # every file but the manifest
    end_of_turn: list[int]  # generation_config's eos_token_id


def import_gguf(gguf_file: Path, out_dir: Path, *, dtype: str = "bfloat16", expect: Path | None = None) -> Imported:
    """Write `gguf_file` as an HF directory at `out_dir` (see the module docstring)."""
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    pin = _read_pin(expect) if expect is not None else None
    if dtype not in DTYPES:
        raise ImportFailed(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    if not gguf_file.is_file():
        raise ImportFailed(f"{gguf_file} is not a file: name a .gguf model file")
    with open(gguf_file, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ImportFailed(f"{gguf_file} is not a GGUF file (it does not start with the GGUF magic)")
    source_sha256 = _file_entry(gguf_file).sha256
    versions = _versions()
    model, tokenizer = _load(gguf_file, dtype)

    with building(out_dir) as staging:
        weights, parameters = _weights_bytes(model, dtype)
        end_of_turn = end_of_turn_ids(tokenizer)
        written = {
            WEIGHTS_FILE: weights,
            "config.json": _json_bytes(_config_dict(model, dtype)),
            "generation_config.json": _json_bytes(_generation_config(model, tokenizer, end_of_turn)),
        }
        del weights
        for name, data in written.items():
            write_synced(staging / name, data)
        tokenizer.save_pretrained(staging)
        files = {name: _file_entry(staging / name) for name in sorted(os.listdir(staging))}
        content_id = files_content_id(files)
        manifest = Manifest(
            content_id=content_id,
            dtype=dtype,
            bytes=sum(entry.size for entry in files.values()),
            checksum="crc32c",
            files=files,
            source=Source(file=gguf_file.name, sha256=source_sha256),
            made_with=versions,
        )
        write_synced(staging / MANIFEST, encode_manifest(manifest, canonical=True))
        reported = weights_content_id(str(staging))
        if reported != content_id:  # an invariant: workers report what the manifest declares
            raise AssertionError(f"protocol.weights_dir reads {reported}, the manifest declares {content_id}")
        if pin is not None:
            _check_pin(pin, expect, manifest, gguf_file, out_dir)
    return Imported(out_dir, content_id, parameters, manifest.bytes, end_of_turn)


def end_of_turn_ids(tokenizer) -> list[int]:
    """The ids that end an assistant turn: the first special token the chat template writes after
    an assistant message's content (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`...), then the
    tokenizer's eos if that is another. A tokenizer without a chat template: its eos alone."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    if getattr(tokenizer, "chat_template", None):
        conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
        if _PROBE not in rendered:
            raise ImportFailed("the chat template drops an assistant turn's content; its end of turn cannot be found")
        after = tokenizer(rendered.split(_PROBE, 1)[1], add_special_tokens=False)["input_ids"]
        special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        ids += [i for i in after if i in special][:1]
    if eos is not None and eos not in ids:
        ids.append(eos)
    if not ids:
        raise ImportFailed("the tokenizer has neither a chat template nor an eos token: nothing would end a reply")
    return ids


# --- internals -------------------------------------------------------------------------------


def _load(gguf_file: Path, dtype: str):
    try:
        import gguf  # noqa: F401 - transformers reads GGUF metadata with it
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ImportFailed(
            f"importing a GGUF file needs the gguf extra ({exc}): pip install 'trainer_svc[gguf]' "
            "(`make real-model` installs it into the trainer venv)"
        ) from None
    gguf_file = gguf_file.resolve()
    where = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name, local_files_only=True)
    # Dense tensors whatever kernels are installed: with a GGUF matmul kernel, transformers 5
    # would otherwise keep the weights packed in their quantized blocks (older ones always unpack).
    dense = {}
    if hasattr(transformers, "GgufConfig"):
        dense["quantization_config"] = transformers.GgufConfig(dequantize=True)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=getattr(torch, dtype), **dense)
    return model, tokenizer


def _weights_bytes(model, dtype: str) -> tuple[bytes, int]:
    import torch
    from safetensors.torch import save

    from .writer import omitted_names

    target = getattr(torch, dtype)
    omit = omitted_names(model)
    tensors = {
        name: value.detach().to(target).contiguous() for name, value in model.state_dict().items() if name not in omit
    }
    parameters = sum(t.numel() for t in tensors.values())
    return save(tensors, metadata={"format": "pt"}), parameters


def _config_dict(model, dtype: str) -> dict:
    """What save_pretrained writes (the config's differences from its defaults), without the
    quantization the weights no longer have and without the writer's version."""
    config = model.config
    config.architectures = [type(model).__name__]
    values = config.to_diff_dict()
    values.pop("transformers_version", None)
    values.pop("quantization_config", None)
    for key in ("dtype", "torch_dtype"):
        if key in values:
            values[key] = dtype
    values.setdefault("dtype" if hasattr(config, "dtype") else "torch_dtype", dtype)
    return values


def _generation_config(model, tokenizer, end_of_turn: list[int]) -> dict:
    values = {"eos_token_id": end_of_turn[0] if len(end_of_turn) == 1 else end_of_turn}
    bos = getattr(model.config, "bos_token_id", None)
    if bos is not None:
        values["bos_token_id"] = bos
    if tokenizer.pad_token_id is not None:
        values["pad_token_id"] = tokenizer.pad_token_id
    return values


def _json_bytes(value) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def _file_entry(path: Path) -> FileEntry:
    import crc32c

    sha, crc, size = hashlib.sha256(), 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            crc = crc32c.crc32c(chunk, crc)
            size += len(chunk)
    return FileEntry(size=size, crc32c=f"{crc:08x}", sha256=sha.hexdigest())


def _versions() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def _read_pin(path: Path) -> dict:
    try:
        pin = json.loads(Path(path).read_text())
        if (
            not isinstance(pin, dict)
            or not isinstance(pin.get("content_id"), str)
            or not isinstance(pin.get("files"), dict)
        ):
            raise ValueError("it needs a content_id string and a files object")
    except (OSError, ValueError, RecursionError) as exc:
        raise ImportFailed(f"pin file {path} is unreadable ({type(exc).__name__}: {exc})") from None
    return pin


def _check_pin(pin: dict, pin_path: Path, manifest: Manifest, gguf_file: Path, out_dir: Path) -> None:
    if manifest.content_id == pin["content_id"]:
        return
    lines = [f"{out_dir}: the import of {gguf_file} is {manifest.content_id}, pinned {pin['content_id']} in {pin_path}"]
    pinned_source = pin.get("source", {}).get("sha256")
    if pinned_source and pinned_source != manifest.source.sha256:
        lines.append(f"  the GGUF file differs: sha256 {manifest.source.sha256}, pinned {pinned_source}")
    built = {name: entry.sha256 for name, entry in manifest.files.items()}
    for name in sorted(set(built) | set(pin["files"])):
        if built.get(name) != pin["files"].get(name):
            lines.append(f"  {name}: sha256 {built.get(name, 'absent')}, pinned {pin['files'].get(name, 'absent')}")
    for name, version in manifest.made_with.items():
        pinned = pin.get("made_with", {}).get(name)
        if pinned and pinned != version:
            lines.append(f"  made with {name} {version}, the pin with {pinned}")
    lines.append(
        f"Nothing was written. If the new build is right (a new library version changed its bytes), pin it: "
        f"trainer-svc import-gguf {gguf_file} {out_dir} --write-pin {pin_path}"
    )
    raise ImportMismatch("\n".join(lines))


def pin_of(manifest: Manifest) -> dict:
    """What a pin file holds: the content id, each file's sha256, the source and the versions."""
    if manifest.files is None or manifest.source is None or manifest.made_with is None:
        raise ValueError(f"the manifest of {manifest.content_id} lacks files, source or made_with: not an import's")
    return {
        "content_id": manifest.content_id,
        "files": {name: entry.sha256 for name, entry in manifest.files.items()},
        "source": {"file": manifest.source.file, "sha256": manifest.source.sha256},
        "made_with": manifest.made_with,
    }


def write_pin(out_dir: Path, pin_path: Path) -> None:
    """Pin the directory `out_dir` holds now (its manifest) in `pin_path`."""
    from protocol.fsio import replace_atomic

    replace_atomic(Path(pin_path), _json_bytes(pin_of(read_manifest(out_dir))))
