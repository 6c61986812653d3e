"""model.attention = "varlen" (trainer_svc.learning.varlen_attention): packed micro-batches
through the model with each sequence attending to itself alone, no dense mask.

On a CPU the attention runs a sequence at a time (the CUDA kernel is tests/gpu's). Checked here
against attention written out from its definition in float64 (softmax of the scaled scores over
the keys a query may see), and, through the whole model, against the padded batch under "sdpa"
within the float32 bound of test_sequence_logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from test_sequence_logprobs import (
    TEMPERATURE,
    assert_logprobs_within,
    assert_within,
    gradients_of,
    ragged_batch,
    rounding_bound,
)

from trainer_svc.distributed import Distributed
from trainer_svc.learning import varlen_attention
from trainer_svc.learning.model import load_policy
from trainer_svc.learning.token_logprobs import sequence_logprobs, use_packing

CPU = Distributed(0, 1, torch.device("cpu"))


def attention_by_definition(q, k, v, cu, scale, window=None):
    """q [T, H, D], k and v [T, Hkv, D]; each query of a sequence over the keys of its own
    sequence at or before it (and within the window), in float64."""
    q, k, v = q.double(), k.double(), v.double()
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros_like(q)
    bounds = cu.tolist()
    for start, end in zip(bounds, bounds[1:], strict=False):
        for i in range(start, end):
            first = start if window is None else max(start, i - window + 1)
            for h in range(heads):
                g = h // (heads // kv_heads)
                scores = torch.tensor([float(q[i, h] @ k[j, g]) * scale for j in range(first, i + 1)])
                weights = torch.softmax(scores, dim=0).double()
                out[i, h] = sum(w * v[j, g] for w, j in zip(weights, range(first, i + 1), strict=True))
    return out


class Attention(torch.nn.Module):  # the module argument: only `training` is read
    pass


@pytest.mark.parametrize("window", [None, 2])
def test_each_sequence_attends_to_itself_alone(window):
    """Grouped-query heads (4 queries on 2 key/value heads), three sequences of 3, 4 and 1."""
    g = torch.Generator().manual_seed(1)
    total, heads, kv_heads, dim = 8, 4, 2, 8
    q = torch.randn(1, heads, total, dim, generator=g)
    k = torch.randn(1, kv_heads, total, dim, generator=g)
    v = torch.randn(1, kv_heads, total, dim, generator=g)
    cu = torch.tensor([0, 3, 7, 8], dtype=torch.int32)
    scale = 1 / math.sqrt(dim)
    out, weights = varlen_attention.varlen_attention_forward(
        Attention(), q, k, v, None, scaling=scale, cu_seq_lens_q=cu, max_length_q=4, sliding_window=window
    )
    assert weights is None and out.shape == (1, total, heads, dim)
    rows = [t[0].transpose(0, 1) for t in (q, k, v)]  # [T, heads, D]
    expected = attention_by_definition(*rows, cu, scale, window)
    assert float((out[0].double() - expected).abs().max()) < 1e-5
    # A query never sees another sequence: one attention over all 8 positions gives another result.
    whole = attention_by_definition(*rows, torch.tensor([0, 8]), scale, window)
    assert float((out[0].double() - whole).abs().max()) > 1e-2


def test_a_padded_call_masks_the_padding():
    """Without boundaries (a padded batch): causal over each row, padded keys unseen."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(3))
    padding = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    out, _ = varlen_attention.varlen_attention_forward(Attention(), q, k, v, padding, scaling=0.5)
    for row, length in ((0, 5), (1, 3)):
        expected = attention_by_definition(
            q[row, :, :length].transpose(0, 1),
            k[row, :, :length].transpose(0, 1),
            v[row, :, :length].transpose(0, 1),
            torch.tensor([0, length]),
            0.5,
        )
        assert float((out[row, :length].double() - expected).abs().max()) < 1e-5
    assert torch.isfinite(out).all()


def test_attention_dropout_in_training_is_refused():
    module = Attention().train()
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(ValueError, match="dropout"):
        varlen_attention.varlen_attention_forward(module, q, q, q, None, dropout=0.1)


@pytest.fixture(scope="module")
def models(tiny_model):
    torch.manual_seed(0)
    padded = load_policy(str(tiny_model), torch.float32, CPU)
    varlen = load_policy(str(tiny_model), torch.float32, CPU, attention="varlen")
    return padded, varlen


def test_the_varlen_model_packs_and_equals_the_padded_batch(models, monkeypatch):
    """Through the whole model: packed under "varlen" (packing automatic there), against the padded
    batch under "sdpa": log-probs, entropies and gradients within the float32 bound, and every
    layer's attention called on the packed row with its boundaries."""
    padded, varlen = models
    assert varlen.config._attn_implementation == varlen_attention.NAME
    assert use_packing("auto", varlen) and not use_packing("auto", padded)
    calls = []
    real = varlen_attention._one_at_a_time
    monkeypatch.setattr(varlen_attention, "_one_at_a_time", lambda *a: calls.append(a[3].tolist()) or real(*a))
    batch = ragged_batch()
    logp, entropy = sequence_logprobs(varlen, batch, TEMPERATURE, packed=True)
    reference, reference_entropy = sequence_logprobs(padded, batch, TEMPERATURE)
    lengths = batch.attention_mask.sum(dim=1).tolist()
    bounds = [0] + [sum(lengths[: i + 1]) for i in range(len(lengths))]
    assert calls == [bounds] * varlen.config.num_hidden_layers
    on = batch.mask.bool()
    bound = rounding_bound(padded, batch)
    assert_logprobs_within(logp[on], reference[on], bound)
    assert_logprobs_within(entropy[on], reference_entropy[on], bound)
    for ours, theirs in zip(gradients_of(varlen, logp, batch), gradients_of(padded, reference, batch), strict=True):
        assert_within(ours, theirs, bound)


def test_the_varlen_model_runs_a_padded_batch_too(models):
    padded, varlen = models
    batch = ragged_batch()
    on = batch.mask.bool()
    logp, _ = sequence_logprobs(varlen, batch, TEMPERATURE)
    reference, _ = sequence_logprobs(padded, batch, TEMPERATURE)
    assert_logprobs_within(logp[on], reference[on], rounding_bound(padded, batch))
