"""What a request's `weights_dir` holds, decided once: one of the four forms of a weights version.

    form = resolve(policy, weights_dir)     # FullWeights | SlotWeights | DeltaWeights | AdapterWeights

- FullWeights: an HF-format directory (rollout_svc.weights), validated: the engine loads its shards.
- SlotWeights: a weight slot (protocol.weight_slots), its slot manifest inspected: the engine
  copies it from shared memory under a reader's lease (rollout_svc.slot_load).
- DeltaWeights: a delta publish (its manifest names `delta_base`), or a full step directory beside
  delta publishes (an anchor, which the delta loader holds for the deltas after it): rebuilt into
  a full directory by rollout_svc.delta_load, which the engine then loads.
- AdapterWeights: a LoRA adapter (its manifest carries `adapter`): checked, copied and served on
  the live base model it names (rollout_svc.adapters).

Guarantees:
- Nothing in the directory is read before WeightsPolicy.check_allowed_dir passed: the directory
  and every entry in it inside the allowed roots, every file a regular one (no FIFO, no device, no
  socket; links followed), and what is not a directory is `weights_not_found`.
- Its manifest.json is then read once (bounded, never a FIFO: protocol.weights_dir.read_manifest),
  and the form follows from that one read, in this order: `adapter`, then `delta_base`, then a step
  directory beside delta publishes, then a slot's files, else full weights. No later step reads the
  manifest to learn the form again; the reads that follow check that the directory was not
  replaced meanwhile (a content id read again after a load or a copy).
- A manifest this contract does not read (absent, not JSON, wrong types, too large) gives no form
  of its own: the directory is judged as full weights or a slot, its content id the files' stats,
  and what it lacks is named (no config.json, no .safetensors weights...).
- Full weights and slots are validated here (rollout_svc.weights.weights_of); an anchor too,
  before the delta loader reads it. Every refusal is a RequestFailed whose message starts with
  the request's `weights_dir`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from protocol import weights_chain
from protocol.messages import ErrorCode
from protocol.weights_dir import Manifest, step_of

from .errors import RequestFailed
from .weights import Weights, WeightsPolicy, declared_manifest, weights_of


@dataclass(frozen=True)
class _Validated:
    weights: Weights  # validated by rollout_svc.weights.weights_of

    @property
    def path(self) -> str:
        return self.weights.path

    @property
    def content_id(self) -> str:
        return self.weights.content_id


class FullWeights(_Validated):
    """An HF-format weights directory, validated."""


class SlotWeights(_Validated):
    """A weight slot, its manifest inspected (`weights.slot`)."""


@dataclass(frozen=True)
class _Declared:
    path: str  # as the request named it
    real_path: str  # symlinks resolved
    manifest: Manifest  # what makes it this form, and the content id it names

    @property
    def content_id(self) -> str:
        return self.manifest.content_id


class DeltaWeights(_Declared):
    """A delta publish, or an anchor of a chain of them: what the delta loader rebuilds (the
    version its manifest names)."""


class AdapterWeights(_Declared):
    """A LoRA adapter directory; `manifest.adapter` names its base (by content id) and rank."""


WeightForm = FullWeights | SlotWeights | DeltaWeights | AdapterWeights


def resolve(policy: WeightsPolicy, weights_dir: str) -> WeightForm:
    """The form of `weights_dir` (see the module docstring). Raises RequestFailed."""
    real = policy.check_allowed_dir(weights_dir)  # before any read of it, its manifest's included
    manifest = declared_manifest(real)
    if manifest is not None and manifest.adapter is not None:
        return AdapterWeights(weights_dir, real, manifest)
    if manifest is not None and manifest.delta_base is not None:
        return DeltaWeights(weights_dir, real, manifest)
    if anchor_of_a_chain(real):
        weights_of(real, weights_dir, manifest)  # checked as any full directory, then held like a rebuild
        if manifest is None:
            raise RequestFailed(
                ErrorCode.WEIGHTS_NOT_FOUND,
                f"weights_dir {weights_dir}: its manifest cannot be read; it is a step directory beside delta "
                "publishes, which need the content id it names: publish it again",
            )
        return DeltaWeights(weights_dir, real, manifest)
    weights = weights_of(real, weights_dir, manifest)
    return SlotWeights(weights) if weights.slot is not None else FullWeights(weights)


def anchor_of_a_chain(real: str) -> bool:
    """Whether the full directory `real` is a step directory beside delta publishes: the deltas
    after it will apply to it, so the delta loader reads it once into the copy it holds (and the
    engine loads the loader's local copy) rather than reading it again, over the network, at the
    first delta."""
    if step_of(os.path.basename(real)) is None:
        return False
    return any(v.delta_base is not None for v in weights_chain.versions(os.path.dirname(real)).values())
