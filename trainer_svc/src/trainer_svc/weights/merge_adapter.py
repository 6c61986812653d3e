"""Export: a LoRA adapter merged into its base, as a full HF directory (`trainer-svc merge-adapter`).

    merge_adapter(adapter_dir, out_dir, base=None) -> Written

The adapter is a LoRA publish or checkpoint (protocol.weights_dir: its manifest names the base's
content id); the base is the one its manifest names (`base_model`) or `base`, and must have that
content id. PEFT applies the adapter (`merge_and_unload`: W + B A * alpha / r in each target) and
the result is written as any published model (writer.py: the base's config and tokenizer
files, safetensors in the base's dtype, manifest last, atomically), loadable by a rollout worker
as ordinary weights or as model.path. Its content id is `merged-<the adapter's>`: one adapter,
one export.
"""

from __future__ import annotations

from pathlib import Path

from protocol import exit_codes
from protocol.weights_dir import ManifestError, read_manifest, weights_content_id

from .writer import Written, omitted_names, write_weights_dir


class MergeRefused(ValueError):
    """The adapter or its base cannot be merged; the message says why and what to do."""

    exit_code = exit_codes.USAGE


def merge_adapter(adapter_dir: Path, out_dir: Path, base: Path | None = None) -> Written:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_dir = Path(adapter_dir)
    try:
        manifest = read_manifest(adapter_dir)
    except (OSError, ManifestError) as exc:
        raise MergeRefused(
            f"{adapter_dir} has no readable manifest ({exc}); name a LoRA publish or checkpoint"
        ) from None
    if manifest.adapter is None:
        raise MergeRefused(f"{adapter_dir} is not a LoRA adapter (its manifest names no base): it is a model already")
    base = Path(base or manifest.base_model or "")
    if not (base / "config.json").is_file():
        raise MergeRefused(f"the adapter's base {base} is not a model directory; give --base BASE_DIR")
    found = weights_content_id(str(base))
    if found != manifest.adapter.base_content_id:
        raise MergeRefused(
            f"{base} has content id {found}; the adapter {adapter_dir} was trained on content id "
            f"{manifest.adapter.base_content_id}: give --base the directory it was trained on"
        )
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    omit = omitted_names(merged)
    with torch.no_grad():
        tensors = {name: t.detach().contiguous() for name, t in merged.state_dict().items() if name not in omit}
    return write_weights_dir(
        Path(out_dir),
        tensors,
        base_model=base,
        step=manifest.step or 0,
        content_id=f"merged-{manifest.content_id}",
    )
