"""The models the benchmarks build (nothing is downloaded): tiny Llamas of rollout_svc.tiny_model,
and Qwen2.5-shaped configs for the real-shape GPU benchmarks; and a model directory's size.

torch, transformers and safetensors are imported inside the functions that use them.
"""

from __future__ import annotations

from pathlib import Path

# Qwen2.5's published configurations (hidden sizes, layers, heads; tied embeddings).
QWEN_SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
}  # fmt: skip
QWEN_VOCAB = 151936
# A tiny shape for the CPU checks of the scripts (their tiny modes); its figures mean nothing.
QWEN_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)  # fmt: skip


def build_models(root: Path, names: list[str], *, hidden: int, layers: int) -> dict[str, Path]:
    """Tiny models of one architecture, one seed per name."""
    from rollout_svc.tiny_model import build

    return {
        name: build(root / name, seed=seed, hidden=hidden, layers=layers, intermediate=3 * hidden, init_std=0.3)
        for seed, name in enumerate(names)
    }


def qwen_config(shape: dict):
    """A Qwen2Config of Qwen2.5's vocabulary and settings at `shape` (QWEN_SHAPES' keys)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=QWEN_VOCAB, max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape,
    )  # fmt: skip


def parameter_count(model_dir: Path) -> int:
    """Elements of every tensor in the directory's safetensors files (read from their headers)."""
    from safetensors import safe_open

    total = 0
    for shard in Path(model_dir).glob("*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                count = 1
                for dim in f.get_slice(name).get_shape():
                    count *= dim
                total += count
    return total
