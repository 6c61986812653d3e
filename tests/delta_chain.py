"""Chains of published weights for the worker's tests: full step directories and delta publishes
(protocol.weights_chain) made from a tiny model, each step also written whole elsewhere, so a test
compares what a worker serves from the chain with what it serves from the full weights.

Plain protocol and safetensors, no trainer_svc: the tests that use this run in the rollout venv
(the trainer's own writer is tested against the worker's loader in tests/trainer)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from protocol import weight_delta
from protocol.weights_chain import DELTA_FILE
from protocol.weights_dir import MANIFEST, Manifest, encode_manifest, step_content_id, step_dir_name

SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def bits(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {
        name: t.contiguous().reshape(-1).view(torch.uint8).numpy().view(f"<u{t.element_size()}").reshape(t.shape)
        for name, t in tensors.items()
    }


def moved(tensors: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """About `fraction` of the elements moved clearly (so greedy outputs change), the rest kept."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        out[name] = torch.where(mask, t + 0.5 * torch.randn(t.shape, generator=g), t).contiguous()
    return out


class Chain:
    """Publishes into `publish_dir` (step_N: full or delta) and `full_dir` (step_N: always full)."""

    def __init__(self, model: Path, publish_dir: Path, full_dir: Path, run: str = "chain"):
        self.model, self.publish_dir, self.full_dir, self.run = model, publish_dir, full_dir, run
        self.tensors = load_file(str(model / "model.safetensors"))
        self.held: dict[str, torch.Tensor] | None = None
        self.held_id: str | None = None
        self.paths: dict[int, Path] = {}
        self.full_paths: dict[int, Path] = {}

    def publish(self, step: int, tensors: dict[str, torch.Tensor], *, full: bool) -> Path:
        content_id = step_content_id(self.run, step)
        self.full_paths[step] = self._write_full(self.full_dir / step_dir_name(step), tensors, step, None)
        dest = self.publish_dir / step_dir_name(step)
        if full:
            self._write_full(dest, tensors, step, content_id)
        else:
            delta = weight_delta.diff_model(bits(self.held), bits(tensors), base_id=self.held_id, content_id=content_id)
            self._write_delta(dest, delta, step)
        self.held, self.held_id = tensors, content_id
        self.paths[step] = dest
        return dest

    def _side_files(self, staging: Path) -> None:
        for name in SIDE_FILES:
            if (self.model / name).is_file():
                shutil.copyfile(self.model / name, staging / name)

    def _write_full(self, dest: Path, tensors, step: int, content_id: str | None) -> Path:
        staging = dest.with_name(f".{dest.name}.partial")
        staging.mkdir(parents=True)
        self._side_files(staging)
        save_file(tensors, str(staging / "model.safetensors"))
        content_id = content_id or step_content_id(self.run + "-full", step)
        manifest = Manifest(step=step, content_id=content_id, created_at=time.time())
        (staging / MANIFEST).write_bytes(encode_manifest(manifest))
        staging.rename(dest)
        return dest

    def _write_delta(self, dest: Path, delta: weight_delta.ModelDelta, step: int) -> None:
        staging = dest.with_name(f".{dest.name}.partial")
        staging.mkdir(parents=True)
        self._side_files(staging)
        (staging / DELTA_FILE).write_bytes(weight_delta.encode(delta))
        manifest = Manifest(step=step, content_id=delta.content_id, delta_base=delta.base_id, created_at=time.time())
        (staging / MANIFEST).write_bytes(encode_manifest(manifest))
        staging.rename(dest)


def delta_bytes(path: Path) -> int:
    return (path / DELTA_FILE).stat().st_size


def manifest_of(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())
