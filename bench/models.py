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
# The shapes a benchmark may be asked for by name: Qwen2.5's, and the tiny one for CPU checks.
BENCH_SHAPES = {**QWEN_SHAPES, "tiny": QWEN_TINY}


def build_models(root: Path, names: list[str], *, hidden: int, layers: int) -> dict[str, Path]:
    """Tiny models of one architecture, one seed per name."""
    from rollout_svc.tiny_model import build

    return {
        name: build(root / name, seed=seed, hidden=hidden, layers=layers, intermediate=3 * hidden, init_std=0.3)
        for seed, name in enumerate(names)
    }


def qwen_config(shape: dict, **overrides):
    """A Qwen2Config of Qwen2.5's vocabulary and settings at `shape` (QWEN_SHAPES' keys); `overrides`
    replace any of them (another tokenizer's vocabulary and special tokens)."""
    from transformers import Qwen2Config

    settings = dict(
        vocab_size=QWEN_VOCAB, max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return Qwen2Config(**{**settings, **shape, **overrides})


def random_model(source: Path, out: Path, shape: str | None = None, seed: int = 1234) -> Path:
    """`source`'s tokenizer (and chat template) with random bf16 weights in `out`: of `source`'s own
    architecture, or, given `shape` (BENCH_SHAPES' keys), of that Qwen2.5 shape at the tokenizer's
    vocabulary (every id the model can sample is one the tokenizer decodes). Such a model almost never
    samples its end-of-turn token, so every completion runs to max_tokens: generation and training at
    a length, not at the length a trained model's answers happen to have. Seeded: two runs built from
    the same arguments hold the same weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(source)
    if shape is not None:
        special = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        config = qwen_config(BENCH_SHAPES[shape], vocab_size=config.vocab_size, **special)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # 1.5B initialised on a CPU takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    generation = Path(source) / "generation_config.json"  # the end-of-turn tokens the engine stops on
    if generation.exists():
        (Path(out) / generation.name).write_bytes(generation.read_bytes())
    del model
    return Path(out)


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
