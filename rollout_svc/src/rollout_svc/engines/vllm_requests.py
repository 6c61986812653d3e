"""What a request asks of vLLM, for the engine process (vllm_host): each prompt's token ids (given,
tokenized, or a conversation rendered with the model's chat template), checked against what the
engine can take; each prompt's SamplingParams and seed; and the completions vLLM gives back as
this service's Completion (ids, sampling logprobs, texts decoded once at the end).

Guarantees: what the engine cannot take from a request (an empty prompt, ids past the vocabulary,
a prompt too long, sampling settings vLLM refuses) is that request's RequestFailed, before
generating; a prompt's seed depends only on the request's seed (or its own, `prompt_seeds`) and
its index, never on the batch it travels in.
"""

from __future__ import annotations

import hashlib

from protocol.messages import ErrorCode, Request

from ..errors import RequestFailed
from .base import Completion


def sampling_params(request: Request, index: int, **overrides):
    """vLLM's SamplingParams for prompt `index` of `request` (`overrides`: for measuring others).

    vLLM detokenizes only for stop strings, which it matches on text: otherwise the texts are
    decoded once per sample at the end (`_completion`), and the sampling logprobs come back in
    vLLM's flat form. vLLM's per-token work for logprobs (each one's token detokenized, a dict
    per position) runs in the host process at every decoding step: 80 prompts x 8 samples x 24
    tokens of SmolLM2-135M on an H200 took 1.05 s with it, 0.73-0.81 s without, 0.52 s without
    logprobs at all (docs/BENCHMARKS.md)."""
    from vllm import SamplingParams

    settings = dict(
        n=request.n_samples_per_prompt,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stop=request.stop or None,
        detokenize=bool(request.stop),
        logprobs=0 if request.logprobs else None,
        flat_logprobs=True,
        seed=seed_of_prompt(request, index),
    )
    return SamplingParams(**(settings | overrides))


def checked_sampling_params(request: Request, index: int):
    """sampling_params, with vLLM's refusal of a setting (a temperature above 2, ...) an error of
    the request's (`invalid_request`, permanent), not of the engine's (`engine_error`, sent again)."""
    from vllm.exceptions import VLLMValidationError

    try:
        return sampling_params(request, index)
    except (VLLMValidationError, ValueError) as exc:
        raise RequestFailed(
            ErrorCode.INVALID_REQUEST,
            f"vLLM refuses the request's sampling settings: {exc}; change the setting it names",
        ) from None


def seed_of_prompt(request: Request, index: int) -> int | None:
    """The engine seed of prompt `index` of `request`: from the prompt's own seed when the request
    gives `prompt_seeds` (so the prompt samples the same in any request and at any position of
    it), else from the request's `seed` and the index (prompt_seed)."""
    if request.prompt_seeds is not None:
        return own_prompt_seed(request.prompt_seeds[index])
    return prompt_seed(request.seed, index)


def own_prompt_seed(seed: int) -> int:
    """The engine seed of a prompt whose request gave it `seed` (prompt_seeds), hashed as
    prompt_seed's are, and for the same reason: vLLM seeds sample j with seed + j, so prompts
    seeded s and s + 1 would share all but one of their samples' random numbers."""
    digest = hashlib.blake2b(f"prompt:{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # below 2**62: vLLM adds the sample's index


def prompt_seed(seed: int | None, index: int) -> int | None:
    """The seed of prompt `index` of a request seeded with `seed` (None: unseeded).

    vLLM seeds the n samples of one prompt with seed, seed + 1, ..., so a request's prompts must
    not share its seed: sample j of every prompt would draw the same random numbers (the same
    junk character ended sample 1 of all 16 prompts of a step). Each prompt gets a seed hashed
    from (seed, index): reproducible, and far from the seeds of the other prompts and of requests
    seeded seed + 1, seed + 2... (the trainer seeds a step's parts so)."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # below 2**62: vLLM adds the sample's index


def prompt_ids(request: Request, tokenizer) -> list[list[int]]:
    """The token ids of each prompt of `request`: given, tokenized from text, or conversations
    rendered with the model's chat template (generation prompt added) and then tokenized without
    special tokens of the tokenizer's own, as the template writes them (what HF's
    `apply_chat_template(tokenize=True)` and vLLM's chat do)."""
    if request.prompt_token_ids:
        return request.prompt_token_ids
    if not request.messages:
        return [tokenizer(p)["input_ids"] for p in request.prompts]
    if not getattr(tokenizer, "chat_template", None):
        raise RequestFailed(
            ErrorCode.NO_CHAT_TEMPLATE,
            "the request gives `messages`, but the loaded model's tokenizer has no chat template "
            "(tokenizer_config.json lacks `chat_template`); send plain-text `prompts` instead, or serve a model "
            "whose tokenizer has one",
        )
    texts = [
        tokenizer.apply_chat_template(
            [{"role": turn.role, "content": turn.content} for turn in conversation],
            add_generation_prompt=True,
            tokenize=False,
        )
        for conversation in request.messages
    ]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def check_prompts(request: Request, ids_per_prompt: list[list[int]], max_len: int, vocab: int) -> None:
    for i, ids in enumerate(ids_per_prompt):
        if not ids:  # vLLM refuses it ("The decoder prompt cannot be empty"): the request's fault, not the engine's
            raise RequestFailed(
                ErrorCode.INVALID_REQUEST,
                f"prompt {i} has no tokens (an empty text); give each prompt at least one character or token id",
            )
        if len(ids) + request.max_tokens > max_len:
            raise RequestFailed(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt {i} has {len(ids)} tokens; with max_tokens {request.max_tokens} that exceeds the "
                f"engine's limit of {max_len} tokens. Shorten the prompt, lower max_tokens, or start the worker "
                "with a larger --max-model-len",
            )
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestFailed(
                ErrorCode.INVALID_REQUEST,
                f"prompt_token_ids[{i}] has token ids outside [0, {vocab}): {bad[:5]}; "
                "tokenize with the tokenizer saved in weights_dir",
            )


def to_completion(outputs, tokenizer, detokenized: bool) -> Completion:
    """One request's answer from vLLM's outputs; texts decoded here unless vLLM `detokenized`
    (the same text: the decoded ids without special tokens)."""
    texts, token_ids, logprobs, finish, prompt_ids, cached = [], [], [], [], [], []
    for output in outputs:
        samples = sorted(output.outputs, key=lambda c: c.index)
        ids = [list(c.token_ids) for c in samples]
        if detokenized:
            texts.append([c.text for c in samples])
        else:
            texts.append([tokenizer.decode(i, skip_special_tokens=True) for i in ids])
        token_ids.append(ids)
        logprobs.append([_sampled_logprobs(c) for c in samples])
        finish.append([c.finish_reason or "length" for c in samples])
        prompt_ids.append(list(output.prompt_token_ids))
        cached.append(int(getattr(output, "num_cached_tokens", None) or 0))  # None: no prefix cache
    return Completion(texts, token_ids, logprobs, finish, prompt_ids, cached_tokens=cached)


def _sampled_logprobs(sample) -> list[float]:
    """The logprob of each sampled token, from vLLM's flat logprobs (`FlatLogprobs`: one list,
    positions delimited by start_indices), where the sampled token comes first at each position."""
    found = sample.logprobs
    if found is None:
        return []
    firsts = found.start_indices
    if [found.token_ids[i] for i in firsts] != list(sample.token_ids):
        raise RuntimeError("vLLM's flat logprobs do not start with the sampled tokens")
    return [found.logprobs[i] for i in firsts]
