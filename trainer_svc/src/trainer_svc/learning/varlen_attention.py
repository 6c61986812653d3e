"""Packed rows through any HF model without a dense mask: an attention function for transformers
(`model.attention = "varlen"`) that runs each sequence of a packed row on its own.

A packed micro-batch (batch.pack) is one row of sequences back to back; `cu_seq_lens` [N + 1]
says where each begins. On CUDA the attention is torch's own varlen kernel
(`torch.nn.attention.varlen.varlen_attn`, FlashAttention inside torch >= 2.10, so no flash-attn
package is needed); on a CPU it is the same attention computed a sequence at a time through
scaled_dot_product_attention, which is how the tests check packed against padded log-probs.
Calls without `cu_seq_lens` (a padded batch, or a single sequence) take scaled_dot_product_attention
with the padding mask, so the model still runs everywhere it ran with "sdpa".

What it gives: no [T, T] mask, no padding computed, one kernel call per layer for the whole
micro-batch. What it does not: attention dropout (training with it is refused) and attention
sinks or soft-capping (models that need them should keep "sdpa" or "eager").
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

NAME = "trainer_svc_varlen"  # the name transformers knows the function by (config._attn_implementation)


def varlen_kernel():
    """torch's varlen attention where this torch has it and a GPU runs it; else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def register() -> str:
    """Make NAME known to transformers (the attention, and the mask it wants: none where causal
    and unpadded, the 2-D padding mask otherwise, as for FlashAttention); returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    return NAME


def varlen_attention_forward(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention interface: query [B, H, T, D], key and value [B, Hkv, T, D];
    returns ([B, T, H, D], no weights). Packed (cu_seq_lens_q given, B = 1): each sequence
    attends causally to itself alone."""
    if dropout and module.training:
        raise ValueError(f"model.attention = 'varlen' takes no attention dropout (the model asks for {dropout})")
    window = kwargs.get("sliding_window")
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        key, value = _per_query_head(key, query.shape[1]), _per_query_head(value, query.shape[1])
        return _padded(query, key, value, attention_mask, scaling, window), None
    if query.shape[0] != 1:
        raise ValueError(f"a packed micro-batch is one row; got {query.shape[0]} rows with cu_seq_lens_q")
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, H or Hkv, D]
    kernel = varlen_kernel()
    if kernel is not None and q.is_cuda:
        # The kernel takes grouped-query heads as they are (FlashAttention reads each key/value
        # head for its group of query heads), so keys and values are not copied per query head.
        longest = int(kwargs.get("max_length_q") or 0)
        left = -1 if window is None else window - 1
        cu32 = cu.to(torch.int32)
        out = kernel(q, k, v, cu32, cu32, longest, longest, scale=scaling, window_size=(left, 0))
    else:
        k, v = _per_query_head(k, q.shape[1]), _per_query_head(v, q.shape[1])
        out = _one_at_a_time(q, k, v, cu, scaling, window)
    return out.unsqueeze(0), None  # [1, T, H, D]


def _per_query_head(kv: Tensor, heads: int) -> Tensor:
    """Grouped-query keys or values, heads on dim 1 ([B, Hkv, T, D] or [T, Hkv, D]), repeated to one
    per query head, for the paths through scaled_dot_product_attention."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _one_at_a_time(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, scaling: float | None, window: int | None) -> Tensor:
    """The varlen kernel's result, a sequence at a time: [T, H, D] each way."""
    bounds = cu.tolist()
    pieces = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        part = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [1, H, n, D]
        mask = _causal(end - start, window, q.device) if window is not None else None
        out = F.scaled_dot_product_attention(*part, attn_mask=mask, is_causal=mask is None, scale=scaling)
        pieces.append(out[0].transpose(0, 1))
    return torch.cat(pieces) if pieces else torch.empty_like(q)


def _padded(
    query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling: float | None, window: int | None
) -> Tensor:
    """An unpacked call: causal attention over each row, padded keys masked out."""
    length = query.shape[2]
    if attention_mask is None and window is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    else:
        mask = _causal(length, window, query.device)[None, None]  # [1, 1, T, T]
        if attention_mask is not None:  # the 2-D padding mask [B, T]
            mask = mask & attention_mask.bool()[:, None, None, -length:]
            # a padded query sees itself at least, so no row is all masked (that would be NaN)
            mask = mask | torch.eye(length, dtype=torch.bool, device=query.device)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)  # [B, T, H, D]


def _causal(length: int, window: int | None, device) -> Tensor:
    """[T, T] bool: query i sees keys j <= i (and, with a sliding window w, j > i - w)."""
    i = torch.arange(length, device=device)
    seen = i[None, :] <= i[:, None]
    if window is not None:
        seen &= i[None, :] > i[:, None] - window
    return seen
