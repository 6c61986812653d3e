"""A LoRA adapter's tensors and files, and its publish: the adapter alone, in PEFT's layout, as the
weight sync (checkpoints hold it the same way; the adapter itself is learning/lora.py's).

    publish_dir/step_00000012/
        adapter_model.safetensors    the adapter's tensors (PEFT's saved names)
        adapter_config.json          PEFT's config (rank, alpha, target modules, the base's path)
        manifest.json                written last: step, content id, files with crc32c, and
                                     `adapter` (the base model's content id, rank, alpha, targets)

API:

    tensors = adapter_tensors(model, dist_info)          # every rank; rank 0 gets PEFT's saved names
    load_adapter_tensors(model, tensors, dist_info, where)   # a checkpoint's adapter back into the model
    adapter_config_json(model, base_model) -> bytes      # adapter_config.json as PEFT writes it
    adapter_of(model, base_content_id) -> Adapter        # the manifest's description of the adapter
    save_adapter_files(directory, model, tensors, base_model)   # a checkpoint's adapter files
    publish_adapter(step, model, *, publish_dir, base_model, base_content_id, dist_info, run_name=None,
                    dtype=None) -> Published | None
    begin_adapter_publish(...same...) -> Begun[Published]   # for a caller finishing it with its own rank-0 work
    write_adapter_dir(dest, tensors, config_json, *, step, content_id, adapter, base_model, dtype=None) -> Written

Guarantees:

- The directory follows protocol.weights_dir (one definition of the manifest for this writer and
  every reader): a worker recognises an adapter by the manifest's `adapter`, serves it on the
  base whose content id it names, and never reloads the base for it.
- Atomic and durable as every directory the trainer writes (atomic_dir.building: each file
  fsynced, renamed into place whole); content ids as for full weights (unique per write), so
  pruning, resume and the requests' `weights_content_id` treat an adapter publish as any other.
- Tensor names in files are PEFT's (`...q_proj.lora_A.weight`: the adapter's name left out, as
  `save_pretrained` writes them), so PEFT, vLLM's LoRA loader and `trainer-svc merge-adapter` read
  a publish or a checkpoint as PEFT's own; `load_adapter_tensors` maps them back and refuses
  tensors that are not exactly the model's adapter.
- Slots and sparse deltas do not apply: an adapter is megabytes, its directory is the sync.

Every rank calls publish_adapter (under FSDP2 the adapter's tensors are gathered one at a time);
rank 0 writes and gets the record, the others None.
"""

from __future__ import annotations

import json
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

from ..distributed import Begun, Distributed
from .atomic_dir import building, remove_stale_partials
from .publish import Published, published_dir
from .streaming import write_small
from .writer import Written

ADAPTER_NAME = "default"  # PEFT's name of the one adapter a model gets from get_peft_model
_MARK = "lora_"  # in the name of every adapter tensor (lora_A, lora_B), in none of the base's


def is_adapter(model) -> bool:
    """Whether `model` is a PEFT model (an adapter on a frozen base)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def saved_name(name: str) -> str:
    """A model's adapter tensor name as PEFT saves it: the adapter's name left out."""
    return name.replace(f".{ADAPTER_NAME}", "")


def adapter_names(model, state: dict | None = None) -> list[str]:
    """The model's adapter tensors, by their state-dict names (adapter name included); `state`:
    the model's state_dict(keep_vars=True), when the caller has it."""
    return [name for name in (state if state is not None else model.state_dict(keep_vars=True)) if _MARK in name]


def adapter_tensors(model, dist_info: Distributed) -> dict[str, torch.Tensor] | None:
    """The adapter's tensors under PEFT's saved names, whole, on CPU, on rank 0 (None elsewhere).
    Every rank must call it: under FSDP2 each tensor is gathered in turn."""
    from torch.distributed.tensor import DTensor

    state = model.state_dict(keep_vars=True)
    found: dict[str, torch.Tensor] = {}
    for name in adapter_names(model, state):
        value = state[name]
        with torch.no_grad():
            full = value.full_tensor() if isinstance(value, DTensor) else value
        if dist_info.is_main:
            found[saved_name(name)] = full.detach().to("cpu", copy=True).contiguous()
        del full
    return found if dist_info.is_main else None


def load_adapter_tensors(model, tensors: dict[str, torch.Tensor], dist_info: Distributed, where: Path) -> None:
    """Put `tensors` (PEFT's saved names, whole; every rank holds them) into the model's adapter.
    Refuses tensors that are not exactly the adapter's (names and shapes), naming `where` they
    came from."""
    state = model.state_dict(keep_vars=True)
    wanted = {saved_name(name): name for name in adapter_names(model, state)}
    missing, unexpected = sorted(set(wanted) - set(tensors)), sorted(set(tensors) - set(wanted))
    resized = sorted(
        f"{name} {list(tensors[name].shape)} (the model's: {list(state[wanted[name]].shape)})"
        for name in set(wanted) & set(tensors)
        if tuple(tensors[name].shape) != tuple(state[wanted[name]].shape)
    )
    if missing or unexpected or resized:
        raise RuntimeError(
            f"{where} does not hold this model's adapter: missing {missing[:4]}, unexpected {unexpected[:4]}, "
            f"other shapes {resized[:2]} (another [lora] rank or target_modules than the run it came from?); "
            "resume with that run's [lora]"
        )
    state = {wanted[name]: tensor for name, tensor in tensors.items()}
    if dist_info.world_size == 1:
        with torch.no_grad():
            model.load_state_dict(state, strict=False)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def adapter_config_json(model, base_model: Path) -> bytes:
    """adapter_config.json for the model's adapter, as PEFT's save_pretrained writes it (sorted
    keys, sets as lists), naming `base_model` as its base."""
    config = model.peft_config[ADAPTER_NAME].to_dict()
    config["base_model_name_or_path"] = str(base_model)
    config["inference_mode"] = True
    config = {key: sorted(value) if isinstance(value, set) else value for key, value in config.items()}
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def adapter_of(model, base_content_id: str) -> Adapter:
    """The manifest's description of the model's adapter."""
    config = model.peft_config[ADAPTER_NAME]
    return Adapter(
        base_content_id=base_content_id,
        rank=int(config.r),
        alpha=float(config.lora_alpha),
        target_modules=sorted(config.target_modules),
    )


def save_adapter_files(directory: Path, model, tensors: dict[str, torch.Tensor], base_model: Path) -> None:
    """The adapter as PEFT's save_pretrained writes it (for a checkpoint: its directory is synced
    whole by whoever builds it)."""
    from safetensors.torch import save_file

    save_file(dict(sorted(tensors.items())), Path(directory) / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (Path(directory) / ADAPTER_CONFIG).write_bytes(adapter_config_json(model, base_model))


def publish_adapter(step: int, model, *, dist_info: Distributed, **options) -> Published | None:
    """Write the model's adapter as publish_dir/step_NNNNNNNN (begin_adapter_publish says the
    options). Returns the record on rank 0, None elsewhere."""
    return begin_adapter_publish(step, model, dist_info=dist_info, **options).finish_on_rank0(
        dist_info, f"publish the adapter of step {step}"
    )


def begin_adapter_publish(
    step: int,
    model,
    *,
    publish_dir: Path,
    base_model: Path,
    base_content_id: str,
    dist_info: Distributed,
    run_name: str | None = None,
    dtype: torch.dtype | None = None,
) -> Begun[Published]:
    """The write of the model's adapter as publish_dir/step_NNNNNNNN (replacing one of that step,
    atomically): its tensors gathered here on every rank, written when rank 0 finishes it.
    dtype None: the adapter's own."""
    tensors = adapter_tensors(model, dist_info)

    def write() -> Published:  # rank 0
        where = Path(publish_dir)
        where.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(where, STEP_PREFIX)
        content_id = step_content_id(run_name or where.absolute().parent.name, step)
        written = write_adapter_dir(
            published_dir(where, step),
            tensors,
            adapter_config_json(model, base_model),
            step=step,
            content_id=content_id,
            adapter=adapter_of(model, base_content_id),
            base_model=base_model,
            dtype=dtype,
        )
        return Published(written.path, step, content_id, written.bytes, written.seconds)

    return Begun(write, agree=dist_info.world_size > 1)


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
