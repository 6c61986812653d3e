"""The tokenizer saved with a weights directory: an id of its files and its size in tokens.

A change of tokenizer files needs a new engine (rollout_svc.engines.vllm); a tokenizer with more
tokens than the model's vocab_size is refused, since ids past the embedding table cannot be served.

Guarantees: the files are read through read_weights_file (bounded, never a FIFO; the directory
passed the allowed-root check before); files identical to the live tokenizer's are not loaded
again; a tokenizer that cannot be read or loaded, or does not fit, is `weights_invalid` naming
the directory and what to do.
"""

from __future__ import annotations

import hashlib
import json
import os

from protocol.messages import ErrorCode
from protocol.weights_dir import TOKENIZER_FILES

from ..errors import RequestFailed
from ..weights import MAX_CONFIG_BYTES, MAX_TOKENIZER_BYTES, Weights, check_tokenizer_fits, read_weights_file


def tokenizer_id(weights: Weights, known: tuple[str | None, int] = (None, 0)) -> tuple[str, int]:
    """An id of the tokenizer files saved with the weights (a change needs a new engine), once
    the tokenizer is known to load and to fit the model's vocabulary; and its size in tokens.
    Files identical to the `known` (id, size) tokenizer's (the live engine's, loaded and checked
    when its weights came) are not loaded again:
    a trainer publishes the same tokenizer every step, and loading a 150k-token tokenizer
    costs 0.3 s, more than the rest of an in-place reload's own work."""
    digest = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        path = os.path.join(weights.real_path, name)
        if os.path.exists(path):
            found = True
            try:
                data = read_weights_file(path, MAX_TOKENIZER_BYTES)
            except (OSError, ValueError) as exc:
                raise RequestFailed(
                    ErrorCode.WEIGHTS_INVALID,
                    f"weights_dir {weights.path}: {name} cannot be read ({exc}); save the tokenizer again",
                ) from None
            digest.update(name.encode() + b"\0" + data)
    if not found:
        raise RequestFailed(
            ErrorCode.WEIGHTS_INVALID,
            f"weights_dir {weights.path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
            "save the tokenizer next to the weights",
        )
    if digest.hexdigest() == known[0]:
        check_tokenizer_fits(weights, known[1])
        return known
    try:
        size = tokenizer_size(weights.real_path)
    except Exception as exc:
        raise RequestFailed(
            ErrorCode.WEIGHTS_INVALID,
            f"weights_dir {weights.path}: the tokenizer does not load ({exc}); save it again with save_pretrained",
        ) from None
    check_tokenizer_fits(weights, size)
    return digest.hexdigest(), size


def tokenizer_size(directory: str) -> int:
    """Tokens of the tokenizer saved in `directory` (transformers' len(tokenizer)). A fast
    tokenizer (tokenizer.json) is read with the `tokenizers` library in 0.3 s: through transformers,
    its import alone cost a worker about 7 s on a 2-core CPU before its engine process even started
    (bench/tokenizer_check.py). Others load through transformers' AutoTokenizer."""
    fast = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(fast):
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(directory))
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(fast)
    known = tokenizer.get_vocab(with_added_tokens=True)
    # Added tokens that only tokenizer_config.json names are appended to the tokenizer when it loads.
    config = os.path.join(directory, "tokenizer_config.json")
    added = {}
    if os.path.exists(config):
        added = json.loads(read_weights_file(config, MAX_CONFIG_BYTES)).get("added_tokens_decoder") or {}
    return len(known) + len({t["content"] for t in added.values()} - known.keys())
