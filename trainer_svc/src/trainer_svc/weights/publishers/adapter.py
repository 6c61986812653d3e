"""A LoRA adapter alone: each publish is the adapter's directory in PEFT's layout (weights.adapters
writes it: megabytes), which the workers apply to the base whose content id it names, never
reloading the base. Pruned, named and resumed as the directory form's step directories."""

from __future__ import annotations

from protocol.weights_dir import weights_content_id

from ...distributed import Begun
from ..adapters import begin_adapter_publish
from ..publish import Published
from .directory import DirectoryPublisher


class AdapterPublisher(DirectoryPublisher):
    form = "adapter"

    def __init__(self, cfg, dist_info, dtype):
        super().__init__(cfg, dist_info, dtype)
        self.base_content_id = weights_content_id(cfg.model.path)  # the base the workers must hold

    def describe(self) -> str:
        return f"LoRA adapter directories in {self.dir} (rank {self.cfg.lora.rank}, on base {self.base_content_id})"

    def begin(self, model, step: int) -> Begun[Published]:
        return begin_adapter_publish(step, model, base_content_id=self.base_content_id, **self._where())
