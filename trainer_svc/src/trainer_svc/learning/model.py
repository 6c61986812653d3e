"""The policy: any HF causal LM, on one process (CPU or one GPU) or sharded with FSDP2.

Under torchrun each decoder layer, then the whole model, is wrapped with `fully_shard`
(FSDP2); gradients are then averaged over ranks, which grpo.rank_scale compensates. With
activation checkpointing each decoder layer recomputes its activations in the backward pass.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..distributed import Distributed

log = logging.getLogger(__name__)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_policy(
    path: str,
    dtype: torch.dtype,
    dist_info: Distributed,
    *,
    activation_checkpointing: bool = False,
    compiled: bool = False,
    lora=None,
    seed: int = 0,
    attention: str = "sdpa",
):
    """`lora` (a LoraConfig with rank > 0): a PEFT adapter on the frozen model (learning/lora.py),
    put on before the layers are compiled or sharded, initialised from `seed` on every rank.
    `attention`: model.attention (sdpa, eager, or varlen: learning/varlen_attention.py)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attention_implementation(attention)
    ).to(dist_info.device)
    model.config.use_cache = False
    if lora is not None and lora.on:
        from .lora import with_adapter

        model = with_adapter(model, lora, seed)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compiled:
        compile_layers(model)
    if dist_info.world_size > 1:
        shard(model)
    return model


def compile_enabled(setting: str, device: torch.device) -> bool:
    """model.compile resolved: "auto" compiles on a GPU only (on a CPU the compilation costs more
    than it saves at the sizes a CPU trains)."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def use_compile_cache() -> str:
    """Where torch.compile keeps what it compiled (inductor's graph and autograd caches and its
    Triton kernels), so that a relaunch, or another run of the same model, loads them instead of
    compiling again: TORCHINDUCTOR_CACHE_DIR when the user set it, else a user cache that
    outlives the launch and /tmp, $XDG_CACHE_HOME/trainer-svc/torchinductor (~/.cache/...).
    Takes effect before the first compilation of the process; returns the directory."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainer-svc" / "torchinductor"
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default))


def compile_layers(model) -> None:
    """Each decoder layer compiled in place. Sequence lengths vary from step to step, so the
    shapes are dynamic from the start (one compilation, not one per length). Activation
    checkpointing and FSDP2 wrap the compiled layer from outside."""
    use_compile_cache()
    for layer in decoder_layers(model):
        layer.compile(dynamic=True)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of an HF causal LM (model.model.layers for Llama, Qwen, Mistral...),
    also under a PEFT adapter."""
    from .lora import base_of

    inner = getattr(base_of(model), "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find its decoder layers (model.model.layers) to shard")
    return list(layers)


def shard(model) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)


def attention_implementation(attention: str) -> str:
    """model.attention as the name transformers knows (varlen: registered with it first)."""
    if attention == "varlen":
        from .varlen_attention import register

        return register()
    return attention


def load_reference(path: str, dtype: torch.dtype, device: torch.device, attention: str = "sdpa"):
    """A frozen copy of the starting model, for the KL term (kept whole on every rank)."""
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention_implementation(attention))
        .to(device)
        .eval()
    )
    for p in model.parameters():
        p.requires_grad_(False)
    return model
