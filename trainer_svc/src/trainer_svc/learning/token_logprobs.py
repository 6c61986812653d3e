"""Log-probabilities and entropies of a micro-batch's generated tokens, without its logits.

The logits are a step's largest tensor: sequences x positions x vocabulary (49,152 to 151,936
entries a position), and the log-softmax needs them in float32. Taken whole, as the trainer did
before, a micro-batch of 512 sequences x 128 generated positions at SmolLM2's vocabulary asked
for 12 GiB for the float32 copy alone, and kept it until the backward pass. Here the model's own output
projection is applied to chunks of the generated positions' hidden states, about CHUNK_BYTES of
float32 logits at a time, and each chunk keeps for the backward pass only its hidden states and
its log-normaliser: the backward makes the chunk's logits again, takes their gradient in one pass
(grpo.logprob_grad) and frees them before the next chunk's. The cost is one more product with
the output projection per generated position.

    hidden [N, L, H] --(columns some sequence generated)--> [N, K, H] --(generated)--> [M, H]
    per chunk of rows: logits = head(rows) [C, V] -> grpo.logprob_stats -> logp, entropy, lse [C]

Guarantees (tests/trainer/test_chunked_logprobs.py, test_sequence_logprobs.py):
- the log-probabilities, entropies and gradients equal those of the whole logits through
  grpo.logprobs_and_entropy within float32 rounding, for every chunk size;
- no tensor of more than one chunk's rows x vocabulary is created, forward or backward, and none
  of vocabulary width is kept for the backward pass: peak memory grows with the chunk, not with
  sequences x length x vocabulary;
- prompts and padding never reach the output projection.

The head runs inside the model's forward (it stands in for the output projection for that one
call), so FSDP2's hooks see an ordinary forward. Models whose logits are more than the head's
output (Gemma's soft-capping, Cohere's or Granite's scaling) are not in FUSED_MODEL_TYPES: their
logits come from the model, [N, K, V] in the model's dtype, and only the float32 math is chunked
(each chunk through torch.utils.checkpoint).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from . import grpo
from .batch import Batch, pack
from .varlen_attention import NAME as VARLEN_NAME

CHUNK_BYTES = 256 * 2**20  # float32 logits a chunk (the chunk's transient peak is about 4x this)
# Architectures whose logits are exactly the output projection of the last hidden state.
FUSED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3"})

LogprobMath = Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor]]


def chunk_rows(vocab_size: int, chunk_bytes: int | None = None) -> int:
    """Positions a chunk holds: as many as fit `chunk_bytes` (default: CHUNK_BYTES, read at the
    call, so a benchmark can set it) of float32 logits, at least one."""
    return max(1, (CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // (4 * vocab_size))


def chunked_logprobs(
    rows: Tensor, project: Callable[[Tensor], Tensor], tokens: Tensor, temperature: float, chunk: int,
    math: LogprobMath = grpo.logprobs_and_entropy,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(logp [M], entropy [M]) of `tokens` [M] under softmax(project(rows) / temperature),
    `chunk` rows at a time; `project` maps rows [C, ...] to logits [C, V]. With gradients
    enabled each chunk is checkpointed: its logits are recomputed in the backward pass instead
    of kept. No rows still make one (empty) chunk, so the result stays in the graph."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 row, got {chunk}")

    def one(part: Tensor, part_tokens: Tensor) -> tuple[Tensor, Tensor]:
        return math(project(part), part_tokens, temperature)

    pieces = []
    for start in range(0, max(rows.shape[0], 1), chunk):
        part, part_tokens = rows[start : start + chunk], tokens[start : start + chunk]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(one, part, part_tokens, use_reentrant=False, preserve_rng_state=False))
        else:
            pieces.append(one(part, part_tokens))
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])


def sequence_logprobs(
    model, batch: Batch, temperature: float, compiled: bool = False, chunk: int | None = None, packed: bool = False
) -> tuple[Tensor, Tensor]:
    """(logprobs [N, L-1], entropy [N, L-1]) of each target token under `model`; 0 at the
    positions whose token was not generated. `chunk`: rows a chunk (default: chunk_rows of the
    vocabulary). The entropy is a statistic, computed without a graph. `compiled`: the float32
    math through torch.compile (one fused kernel per pass over a chunk). `packed`: the sequences
    go through the model back to back in one row (batch.pack), no padding computed; the model's
    attention keeps them apart by their restarting positions (use_packing says where it can)."""
    mask = batch.mask.bool()  # [N, L-1]
    if packed:
        row = pack(batch)
        source = row.mask.bool()  # [1, T-1]: its generated positions are mask's, in the same order
        inputs = {"input_ids": row.input_ids, "position_ids": row.position_ids, "use_cache": False}
        # varlen kernels (flash_attention_2/3, model.attention = "varlen") read the boundaries here
        inputs |= {"cu_seq_lens_q": row.cu_seq_lens, "cu_seq_lens_k": row.cu_seq_lens}
        inputs |= {"max_length_q": row.max_length, "max_length_k": row.max_length}
        targets = row.targets
    else:
        source, targets = mask, batch.targets
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    columns = source.any(dim=0).nonzero().squeeze(-1)  # [K] positions some sequence generated
    chosen = source[:, columns]  # [rows, K]
    tokens = targets[:, columns][chosen]  # [M], in the row-major order of mask
    lm = causal_lm(model)
    rows_per_chunk = chunk or chunk_rows(lm.config.vocab_size)
    inputs["logits_to_keep"] = columns
    if fusable(lm):
        head = lm.get_output_embeddings()
        lm.set_output_embeddings(_LogprobHead(head, chosen, tokens, temperature, rows_per_chunk, compiled))
        try:
            out = model(**inputs).logits  # [M, 2]: (logp, entropy) of each generated position
        finally:
            lm.set_output_embeddings(head)
        logp, entropy = out[:, 0], out[:, 1]
    else:
        logits = model(**inputs).logits  # [N, K, V]
        where = chosen.nonzero()  # [M, 2]: rows are (sequence, column) pairs, gathered chunk by chunk
        math = compiled_logprob_math() if compiled else grpo.logprobs_and_entropy
        logp, entropy = chunked_logprobs(
            where, lambda idx: logits[idx[:, 0], idx[:, 1]], tokens, temperature, rows_per_chunk, math
        )
    zeros = torch.zeros(mask.shape, dtype=logp.dtype, device=logp.device)
    return zeros.masked_scatter(mask, logp), zeros.masked_scatter(mask, entropy)


def head_logprobs(
    rows: Tensor, head, tokens: Tensor, temperature: float, chunk: int, compiled: bool = False
) -> tuple[Tensor, Tensor]:
    """(logp [M], entropy [M]) of `tokens` [M] under softmax(head(rows) / temperature), `chunk`
    rows at a time. With gradients enabled each chunk is one _HeadChunk: its logits are made
    again in the backward pass, where their gradient takes one pass (grpo.logprob_grad)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 row, got {chunk}")
    stats, grad = compiled_head_math() if compiled else (grpo.logprob_stats, grpo.logprob_grad)
    params = tuple(p for p in head.parameters() if p.requires_grad)
    pieces = []
    for start in range(0, max(rows.shape[0], 1), chunk):  # no rows: one empty chunk, still in the graph
        part, part_tokens = rows[start : start + chunk], tokens[start : start + chunk]
        if torch.is_grad_enabled() and (part.requires_grad or params):
            pieces.append(_HeadChunk.apply(part, part_tokens, temperature, head, stats, grad, *params))
        else:
            pieces.append(stats(head(part), part_tokens, temperature)[:2])
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])


class _HeadChunk(torch.autograd.Function):
    """One chunk's (logp, entropy) from its hidden rows: the forward keeps the rows and the
    log-normaliser (C numbers), not the logits [C, V]; the backward makes the logits again,
    takes d logp / d logits in one pass and sends it through the head to the rows and the head's
    parameters (given as inputs, so that autograd asks for their gradients)."""

    @staticmethod
    def forward(ctx, rows, tokens, temperature, head, stats, grad, *params):
        with torch.no_grad():
            logp, entropy, lse = stats(head(rows), tokens, temperature)
        ctx.save_for_backward(rows, tokens, lse, *params)
        ctx.temperature, ctx.head, ctx.grad = temperature, head, grad
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        rows, tokens, lse, *params = ctx.saved_tensors
        wants_rows, wants_params = ctx.needs_input_grad[0], ctx.needs_input_grad[6:]
        with torch.enable_grad():
            hidden = rows.detach().requires_grad_(wants_rows)
            logits = ctx.head(hidden)
        grad_logits = ctx.grad(logits.detach(), tokens, lse, grad_logp, ctx.temperature)
        wanted = ([hidden] if wants_rows else []) + [p for p, wants in zip(params, wants_params, strict=True) if wants]
        found = iter(torch.autograd.grad(logits, wanted, grad_logits, allow_unused=True))
        grad_rows = next(found) if wants_rows else None
        return (grad_rows, None, None, None, None, None, *(next(found) if w else None for w in wants_params))


class _LogprobHead(torch.nn.Module):
    """Stands in for a model's output projection during one forward: from the hidden states at
    the kept columns [N, K, H], the (logp, entropy) of each generated position, [M, 2]."""

    def __init__(self, head, chosen: Tensor, tokens: Tensor, temperature: float, chunk: int, compiled: bool):
        super().__init__()
        self.head = head
        self.chosen, self.tokens, self.temperature, self.chunk, self.compiled = (
            chosen, tokens, temperature, chunk, compiled
        )  # fmt: skip

    def forward(self, hidden: Tensor) -> Tensor:
        rows = hidden[self.chosen]  # [M, H]
        logp, entropy = head_logprobs(rows, self.head, self.tokens, self.temperature, self.chunk, self.compiled)
        return torch.stack([logp, entropy], dim=-1)


def causal_lm(model):
    """The HF causal LM that computes `model`'s logits: under a PEFT adapter, or under the
    adapter-off view of it that serves as the KL reference, the base model."""
    from .lora import base_of

    return base_of(getattr(model, "policy", model))


def fusable(lm) -> bool:
    """Whether `lm`'s logits are its output projection of the last hidden state alone."""
    kind = getattr(getattr(lm, "config", None), "model_type", None)
    return kind in FUSED_MODEL_TYPES and lm.get_output_embeddings() is not None


@functools.cache
def compiled_head_math():
    # The forward's and the backward's pass over a chunk [C, V], each one fused kernel; C varies.
    return torch.compile(grpo.logprob_stats, dynamic=True), torch.compile(grpo.logprob_grad, dynamic=True)


@functools.cache
def compiled_logprob_math() -> LogprobMath:
    # One fused kernel per pass over a chunk [C, V] instead of one per elementwise op; C varies.
    return torch.compile(grpo.logprobs_and_entropy, dynamic=True)


# Attention that takes packed rows without a dense mask: varlen kernels. sdpa and eager take them
# too, through a [T, T] mask per row, which for a micro-batch of many long sequences costs more
# than the padding it saves: there the sequences are sorted by length instead (train.packing = "on"
# forces packing anyway).
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", VARLEN_NAME)


def use_packing(setting: str, model) -> bool:
    """Whether train.packing (`auto`, `on`, `off`) packs micro-batches for `model`."""
    if setting != "auto":
        return setting == "on"
    return getattr(causal_lm(model).config, "_attn_implementation", None) in VARLEN_ATTENTION
