"""Tiny HF models and bit-exact comparisons of weights, shared by the trainer tier's weights_writer
tests and the GPU tier's (tests/gpu/test_weights_writer_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import torch


def load_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that equality is bit equality (NaN payloads and -0.0 included)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape, name
        assert torch.equal(bits(got[name]), bits(want[name])), name


def read_all(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def build_llama(path: Path, *, tied: bool = True) -> Path:
    """A tiny Llama; with `tied` its lm_head is its embedding table (tie_word_embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        tie_word_embeddings=tied,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path
