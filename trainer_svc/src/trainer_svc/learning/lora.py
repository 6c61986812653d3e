"""LoRA: a PEFT adapter trained on the frozen base model (`[lora]`, rank > 0).

    model = with_adapter(base, cfg.lora, seed)           # before compile and FSDP2 (model.load_policy)
    reference = AdapterDisabled(model)                   # the KL reference: the base, adapter off
    base_of(model)                                       # the HF model under the adapter

The adapter's tensors and files (publish, checkpoint, PEFT's names) are weights/adapters.py's.

Guarantees:
- Only the adapter's parameters require gradients (PEFT freezes the base), so the optimizer,
  its state and a checkpoint hold the adapter alone; under FSDP2 the adapter is sharded with the
  decoder layers it sits in.
- Every rank starts from the same adapter (drawn from the run's seed alone).
- The reference model of the KL term is the same module with its adapter switched off: no second
  copy of the base in memory.
"""

from __future__ import annotations

import torch

from ..config import LoraConfig
from ..weights.adapters import ADAPTER_NAME, is_adapter


def with_adapter(model, lora: LoraConfig, seed: int = 0):
    """`model` (an HF causal LM) with a fresh LoRA adapter; its own parameters frozen. The
    adapter's initialisation (lora_A random, lora_B zero) is drawn from `seed` alone, the global
    RNG left as it was: every FSDP2 rank starts from the same adapter, as from the same base."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return get_peft_model(model, config, adapter_name=ADAPTER_NAME)
    except ValueError as exc:  # PEFT: a target module the model does not have
        names = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if _is_linear(module)})
        raise ValueError(
            f"lora.target_modules {list(lora.target_modules)} cannot be applied to {type(model).__name__} ({exc}); "
            f"its linear layers are named {names}"
        ) from None


def _is_linear(module) -> bool:
    return isinstance(module, torch.nn.Linear)


def base_of(model):
    """The HF model under an adapter (the model itself without one)."""
    return model.get_base_model() if is_adapter(model) else model


class AdapterDisabled(torch.nn.Module):
    """The base model under a PEFT adapter, for the KL term: the policy's own module called with
    its adapter switched off, so the starting model costs no second copy in memory (the adapter
    starts at zero: lora_B is initialised to 0, so the base is the starting policy)."""

    def __init__(self, model):
        super().__init__()
        self._policy = (model,)  # a tuple: not registered as a submodule, so no parameters of its own

    @property
    def policy(self):
        """The policy whose base this is (its output projection computes the reference's logits)."""
        return self._policy[0]

    def forward(self, **inputs):
        policy = self.policy
        with policy.disable_adapter():
            return policy(**inputs)
