"""LoRA: a PEFT adapter trained on the frozen base model (`[lora]`, rank > 0).

    model = with_adapter(base, cfg.lora)                 # before compile and FSDP2 (model.load_policy)
    tensors = adapter_tensors(model, dist_info)          # every rank; rank 0 gets PEFT's saved names
    load_adapter_tensors(model, tensors, dist_info)      # a checkpoint's adapter back into the model
    reference = AdapterDisabled(model)                   # the KL reference: the base, adapter off
    adapter_config_json(model, base_model) -> bytes      # adapter_config.json as PEFT writes it
    adapter_of(model, base_content_id) -> Adapter        # the manifest's description of the adapter

Guarantees:
- Only the adapter's parameters require gradients (PEFT freezes the base), so the optimizer,
  its state and a checkpoint hold the adapter alone; under FSDP2 the adapter is sharded with the
  decoder layers it sits in, and gathered one tensor at a time for a publish or a checkpoint.
- Tensor names in files are PEFT's (`...q_proj.lora_A.weight`: the adapter's name left out, as
  `save_pretrained` writes them), so PEFT, vLLM's LoRA loader and `trainer-svc merge-adapter` read
  a publish or a checkpoint as PEFT's own; `load_adapter_tensors` maps them back and refuses a
  file whose tensors are not exactly the model's adapter.
- The reference model of the KL term is the same module with its adapter switched off: no second
  copy of the base in memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from protocol.weights_dir import Adapter

from ..config import LoraConfig
from ..distributed import Distributed

ADAPTER_NAME = "default"  # PEFT's name of the one adapter a model gets from get_peft_model
_MARK = "lora_"  # in the name of every adapter tensor (lora_A, lora_B), in none of the base's


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


def is_adapter(model) -> bool:
    """Whether `model` is a PEFT model (an adapter on a frozen base)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def base_of(model):
    """The HF model under an adapter (the model itself without one)."""
    return model.get_base_model() if is_adapter(model) else model


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
    Refuses tensors that are not exactly the adapter's, naming `where` they came from."""
    wanted = {saved_name(name): name for name in adapter_names(model)}
    missing, unexpected = sorted(set(wanted) - set(tensors)), sorted(set(tensors) - set(wanted))
    if missing or unexpected:
        raise RuntimeError(
            f"{where} does not hold this model's adapter: missing {missing[:4]}, unexpected {unexpected[:4]} "
            "(another [lora] rank or target_modules than the run it came from?); resume with that run's [lora]"
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


class AdapterDisabled(torch.nn.Module):
    """The base model under a PEFT adapter, for the KL term: the policy's own module called with
    its adapter switched off, so the starting model costs no second copy in memory (the adapter
    starts at zero: lora_B is initialised to 0, so the base is the starting policy)."""

    def __init__(self, model):
        super().__init__()
        self._policy = (model,)  # a tuple: not registered as a submodule, so no parameters of its own

    def forward(self, **inputs):
        policy = self._policy[0]
        with policy.disable_adapter():
            return policy(**inputs)


def save_adapter_files(directory: Path, model, tensors: dict[str, torch.Tensor], base_model: Path) -> None:
    """The adapter as PEFT's save_pretrained writes it (for a checkpoint: its directory is synced
    whole by whoever builds it)."""
    from safetensors.torch import save_file

    from protocol.weights_dir import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    save_file(dict(sorted(tensors.items())), Path(directory) / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (Path(directory) / ADAPTER_CONFIG).write_bytes(adapter_config_json(model, base_model))
