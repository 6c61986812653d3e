"""Resume checkpoints: what a relaunch needs, in one atomically renamed directory, every
`checkpoint.every` steps and at every stop, at the end and when the tripwire fires. (The weight
sync is separate: weights.sync publishes the weights alone, every `publish.every` steps.)

    run_dir/checkpoints/step_00000012/
        config.json, generation_config.json, tokenizer files   copied from the base model
        model.safetensors (or shards + index)                 the policy's weights; with LoRA the
                                                              adapter alone (adapter_model.safetensors,
                                                              adapter_config.json: PEFT's layout)
        manifest.json                                         step, content id, base model (protocol.weights_dir)
        PINNED                                                when the tripwire fired: never pruned
        rollout_weights/                                      between two publishes: a copy of the
                                                              published weights the requests name
        trainer_state/                                        what a resume needs
            optimizer.pt      torch.save of tensors only, read back with weights_only=True
            rng.safetensors   torch RNG states
            state.json        step, scheduler, data cursor, counters, tripwire, requests in flight,
                              the weights they name, the step's metrics row

It is written into a hidden sibling and renamed into place, so a resume never sees half a
checkpoint; the weights are an HF directory (a worker or an eval job can load them too).
`restore` continues a run from the newest one.

With `publish.every > 1` a checkpoint can fall between two publishes: its weights are newer
than those the requests name. It records which those are, and keeps a copy of them
(`rollout_weights/`, hard links where one filesystem holds both), so a resume samples from the
same weights as the uninterrupted run even when the publish directory lost them (a tmpfs
emptied by a reboot).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError

from protocol import exit_codes
from protocol.weight_slots import is_slot
from protocol.weights_dir import (
    COPIED_FILES,
    MANIFEST,
    STEP_PREFIX,
    Manifest,
    encode_manifest,
    read_manifest,
    step_content_id,
    step_dir_name,
    step_of,
    weights_content_id,
)

from ..distributed import Distributed
from .adapters import adapter_of, adapter_tensors, is_adapter, load_adapter_tensors, save_adapter_files
from .atomic_dir import building, remove_stale_partials

log = logging.getLogger(__name__)

STATE_DIR = "trainer_state"
ROLLOUT_WEIGHTS = "rollout_weights"  # the published weights the requests name, when not the checkpoint's own
PINNED_FILE = "PINNED"  # a checkpoint holding this file is never pruned


class CheckpointWriteFailed(OSError):
    """A checkpoint could not be written (a full disk, most often). Nothing of it is kept and the
    older checkpoints are untouched: a relaunch resumes from the newest of them."""

    exit_code = exit_codes.CANNOT_WRITE


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    content_id: str


@dataclass
class RunState:
    """Where a run stands, besides weights, optimizer and RNG; a resume restores it."""

    step: int = 0
    horizon: int | None = None  # train.steps the run was started with (None: a fresh run)
    started_at: float = field(default_factory=time.time)
    in_flight: list[dict] = field(default_factory=list)  # sampling calls sent, not yet trained on (StepSampler)
    spares: dict | None = None  # the dead-rate measurements that size the spares (rollout.spares.SpareSizer)
    rollout_weights: dict | None = None  # the WeightsRef requests named at the save (None: older checkpoints)
    row: dict | None = None  # the checkpoint step's metrics row, as known at the save


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / step_dir_name(step)


def latest(run_dir: Path) -> Checkpoint | None:
    """The newest complete checkpoint (renamed into place, so complete by construction)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return None
    steps = sorted(
        (p for p in root.iterdir() if step_of(p.name) is not None and (p / MANIFEST).exists()),
        key=lambda p: step_of(p.name),
    )
    if not steps:
        return None
    manifest = read_manifest(steps[-1])
    if manifest.step is None:
        raise ValueError(f"{steps[-1] / MANIFEST} names no step, as a checkpoint's always does: remove {steps[-1]}")
    return Checkpoint(steps[-1], manifest.step, manifest.content_id)


def full_state_dict(model, dist_info: Distributed) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on CPU, on rank 0 (None elsewhere). Every rank must call it."""
    if dist_info.world_size == 1:
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if dist_info.is_main else None


def full_optimizer_state(model, optimizer, dist_info: Distributed) -> dict | None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(model, optimizer, options=options)
    return state if dist_info.is_main else None


def load_optimizer_state(model, optimizer, path: Path, dist_info: Distributed) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = (
        torch.load(path, map_location="cpu", weights_only=True)
        if dist_info.is_main or dist_info.world_size == 1
        else {}
    )
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist_info.world_size > 1)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=options)


def save(
    *,
    run_dir: Path,
    step: int,
    model,
    optimizer,
    base_model: Path,
    trainer_state: dict,
    dist_info: Distributed,
    pin_reason: str | None = None,
    rollout_weights: Path | None = None,
) -> Checkpoint | None:
    """Write checkpoint `step` (all ranks call; rank 0 writes). Returns it on rank 0. With
    `pin_reason` it is written pinned (never pruned); with `rollout_weights` (a published
    directory) it keeps a copy of them."""
    adapter = is_adapter(model)  # LoRA: the adapter alone, in PEFT's layout; the base is model.path's
    weights = adapter_tensors(model, dist_info) if adapter else full_state_dict(model, dist_info)
    optimizer_state = full_optimizer_state(model, optimizer, dist_info)
    if not dist_info.is_main:
        return None
    final = checkpoint_dir(run_dir, step)
    content_id = step_content_id(run_dir.name, step)
    try:
        # A save of this step from a run that stopped before recording it is replaced whole.
        with building(final) as staging:
            if adapter:
                save_adapter_files(staging, model, weights, base_model)
            else:
                _unwrap(model).save_pretrained(staging, state_dict=weights, safe_serialization=True)
                for name in COPIED_FILES:
                    if (base_model / name).exists():
                        shutil.copyfile(base_model / name, staging / name)
            state_dir = staging / STATE_DIR
            state_dir.mkdir()
            torch.save(optimizer_state, state_dir / "optimizer.pt")
            _save_rng(state_dir / "rng.safetensors")
            (state_dir / "state.json").write_text(json.dumps(trainer_state, indent=1, sort_keys=True))
            manifest = Manifest(
                step=step,
                content_id=content_id,
                base_model=str(base_model),
                created_at=time.time(),
                adapter=adapter_of(model, weights_content_id(base_model)) if adapter else None,
            )
            (staging / MANIFEST).write_bytes(encode_manifest(manifest))
            if rollout_weights is not None:
                link_or_copy_tree(rollout_weights, staging / ROLLOUT_WEIGHTS)
            if pin_reason is not None:
                pin(staging, pin_reason)
    except (RuntimeError, SafetensorError) as exc:  # torch.save and safetensors name no errno
        raise CheckpointWriteFailed(errno.EIO, f"writing checkpoint {final} failed ({exc})") from exc
    except OSError as exc:
        if exc.filename is None:  # a failed write() names no file
            raise CheckpointWriteFailed(exc.errno, f"writing checkpoint {final} failed ({exc.strerror})") from exc
        raise
    return Checkpoint(final, step, content_id)


def link_or_copy_tree(source: Path, dest: Path) -> None:
    """`dest` holds `source`'s files: hard links (no bytes written) where both are on one
    filesystem, copies elsewhere. Published files are never changed in place, so a link is a copy.
    A weight slot's tensors.bin is rewritten in place (and its writer refuses one with a second
    link), so a slot's regular files are copied, never linked, and its readers/ left out."""
    dest.mkdir()
    slot = is_slot(source)
    for entry in sorted(Path(source).iterdir()):
        if slot:
            if stat.S_ISREG(entry.lstat().st_mode):
                shutil.copyfile(entry, dest / entry.name)
            continue
        try:
            os.link(entry, dest / entry.name)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            shutil.copyfile(entry, dest / entry.name)


def save_and_prune(
    cfg,
    step: int,
    policy,
    trainer_state: dict,
    dist_info: Distributed,
    pin_reason: str | None = None,
    rollout_weights=None,
) -> Checkpoint:
    """Save checkpoint `step`, then keep the newest `checkpoint.keep_last` (and pinned ones).
    Every rank calls it and gets the new checkpoint back. `rollout_weights`: the WeightsRef the
    next requests name; published at an earlier step, a copy goes into the checkpoint."""
    between_publishes = rollout_weights is not None and rollout_weights.step not in (None, step)
    saved = save(
        run_dir=cfg.run_dir,
        step=step,
        model=policy.model,
        optimizer=policy.optimizer,
        base_model=Path(cfg.model.path),
        trainer_state=trainer_state,
        dist_info=dist_info,
        pin_reason=pin_reason,
        rollout_weights=Path(rollout_weights.dir) if between_publishes else None,
    )
    if dist_info.is_main:
        prune(cfg.run_dir, cfg.checkpoint.keep_last)
    return dist_info.from_rank0(saved)  # also the barrier: no rank runs ahead of the save


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whether in one safetensors file or in shards (large models
    are saved in several, listed by model.safetensors.index.json)."""
    from safetensors.torch import load_file

    shards = sorted(Path(path).glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{path} holds no safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(shard))
    return weights


def load_trainer_state(checkpoint: Checkpoint) -> dict:
    state_dir = checkpoint.path / STATE_DIR
    _load_rng(state_dir / "rng.safetensors")
    return json.loads((state_dir / "state.json").read_text())


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints, never a pinned one."""
    root = run_dir / "checkpoints"
    steps = sorted((p for p in root.iterdir() if step_of(p.name) is not None), key=lambda p: step_of(p.name))
    removed = []
    for path in steps[: max(0, len(steps) - keep_last)]:
        if not (path / PINNED_FILE).exists():
            shutil.rmtree(path)
            removed.append(path)
    remove_stale_partials(root, STEP_PREFIX)  # from a crash mid-save
    return removed


def pin(checkpoint: Path, reason: str) -> None:
    (checkpoint / PINNED_FILE).write_text(reason + "\n")


def _unwrap(model):
    return getattr(model, "module", model)


def _save_rng(path: Path) -> None:
    from safetensors.torch import save_file

    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    save_file(states, path)


def _load_rng(path: Path) -> None:
    from safetensors.torch import load_file

    states = load_file(path)
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def restore(run_dir: Path, model, optimizer, scheduler, stream, tripwire, dist_info: Distributed):
    """Continue from the newest checkpoint of run_dir, if there is one: weights, optimizer, RNG,
    scheduler, data cursor and tripwire. Returns (RunState, the checkpoint or None)."""
    found = latest(run_dir)
    if found is None:
        return RunState(), None
    weights = load_weights(found.path)
    if is_adapter(model):
        load_adapter_tensors(model, weights, dist_info, found.path)
    elif dist_info.world_size == 1:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"{found.path} does not match the model: missing {missing}, unexpected {unexpected}")
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    load_optimizer_state(model, optimizer, found.path / STATE_DIR / "optimizer.pt", dist_info)
    saved = load_trainer_state(found)
    scheduler.load_state_dict(saved["scheduler"])
    stream.load_state_dict(saved["stream"])
    tripwire.load_state_dict(saved["tripwire"])
    log.info("RESUMED from %s at step %d", found.path, saved["step"])
    return (
        RunState(
            step=saved["step"],
            horizon=saved["horizon"],
            started_at=saved["started_at"],
            in_flight=saved.get("in_flight", []),  # absent from checkpoints of synchronous runs before ahead existed
            spares=saved.get("spares"),  # absent from checkpoints before the spares were sized
            rollout_weights=saved.get("rollout_weights"),
            row=saved.get("row"),
        ),
        found,
    )
