"""Build a tiny Llama-architecture model with its own character tokenizer, offline.

For tests and the demo: nothing is downloaded, the same seed gives byte-identical files, and
both transformers and vLLM load the result. Each printable ASCII character is one token, so a
text and its token ids map one to one (the round trip is tested).

Traps avoided: the tokenizer class is written explicitly (an architecture-specific tokenizer
class could replace the stored pre-tokenizer and change the ids), spaces are not cleaned up on
decode, and the attention head size is 64 (vLLM's CPU attention refuses 16).

`write_tokenizer` also serves models of other shapes built on the spot (the GPU benchmarks'
Qwen2 shapes): given a vocabulary size it fills the ids past the characters with filler tokens,
so every id a randomly initialised model samples decodes to text; encoding is unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import string
import tempfile
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
CHARACTERS = " \n" + string.digits + string.ascii_letters + string.punctuation
HEAD_DIM = 64


def build_tokenizer(vocab_size: int | None = None):
    """The character tokenizer; with `vocab_size`, ids past the characters up to it decode to
    filler tokens `<|N|>` (never produced by encoding: there are no merges)."""
    from tokenizers import Tokenizer, decoders, models

    tokens = SPECIAL_TOKENS + list(CHARACTERS)
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(f"vocab_size {vocab_size} is below the {len(tokens)} tokens of the character tokenizer")
        tokens += [f"<|{i}|>" for i in range(len(tokens), vocab_size)]
    vocab = {token: i for i, token in enumerate(tokens)}
    # BPE without merges splits any text into single characters; Fuse joins them back as-is.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def vocab_size() -> int:
    # Rounded up to a multiple of 64, as real models pad their embedding tables.
    n = len(SPECIAL_TOKENS) + len(CHARACTERS)
    return (n + 63) // 64 * 64


def build(
    out: Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 128,
    intermediate: int = 384,
    max_positions: int = 512,
    init_std: float = 0.02,
) -> Path:
    """Write the model to `out` atomically (a temporary sibling, renamed into place).

    `init_std` 0.02 is the usual initialisation, right for training (the demo): its
    near-uniform outputs leave room to explore. Engine tests pass a wide one (0.3) so that
    greedy decoding has clear gaps between logits and does not hinge on rounding."""
    if hidden % HEAD_DIM:
        raise ValueError(f"hidden size {hidden} must be a multiple of the head size {HEAD_DIM}")
    out = Path(out).absolute()
    if out.exists():
        raise FileExistsError(f"{out} exists; remove it or choose another directory")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size(),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // HEAD_DIM,
        num_key_value_heads=hidden // HEAD_DIM,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        write_tokenizer(staging, max_positions=max_positions)
        # mkdtemp makes a private directory; a worker running as another user must read it.
        os.chmod(staging, 0o755)
        for path in staging.iterdir():
            os.chmod(path, 0o644)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def write_tokenizer(directory: Path, *, max_positions: int, vocab_size: int | None = None) -> None:
    """Save the character tokenizer (see build_tokenizer) into a model directory."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(vocab_size),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=max_positions,
        # "<s>" typed in a prompt is three characters, not the start token.
        split_special_tokens=True,
    )
    tokenizer.save_pretrained(directory)
    _pin_tokenizer_class(Path(directory))


def _pin_tokenizer_class(model_dir: Path) -> None:
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["clean_up_tokenization_spaces"] = False
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
