"""model.attention = "varlen" on a GPU: torch's varlen kernel over packed micro-batches, with a
model of SmolLM2-135M's shape (grouped-query heads, random weights) in bf16.

The packed bf16 log-probs must be as close to the float32 padded ones as the padded bf16 ones
are (both are bf16 computations of the same function; the ratio of their errors is compared side
by side, not against a figure from one machine), and its gradients must point where the padded
batch's do."""

from __future__ import annotations

import copy

import pytest
import torch
from test_memory_gate_gpu import SMOLLM2_135M, word_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from trainer_svc.distributed import Distributed
from trainer_svc.learning import varlen_attention
from trainer_svc.learning.batch import collate
from trainer_svc.learning.model import load_policy
from trainer_svc.learning.token_logprobs import sequence_logprobs, use_packing
from trainer_svc.rollout_types import Group, Sample

GPU = Distributed(0, 1, torch.device("cuda", 0))


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm2-shape")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(torch.bfloat16).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


def ragged(vocab: int):
    """8 groups of 2: prompts of 40 to 200 tokens, completions of 10 to 600."""
    g = torch.Generator().manual_seed(3)
    groups = []
    for _ in range(8):
        prompt = torch.randint(3, vocab, (int(torch.randint(40, 200, (1,), generator=g)),), generator=g).tolist()
        samples = []
        for _ in range(2):
            n = int(torch.randint(10, 600, (1,), generator=g))
            samples.append(Sample(torch.randint(3, vocab, (n,), generator=g).tolist(), [-1.0] * n, "", "length"))
        groups.append(Group(prompt, samples))
    return collate(groups, torch.randn(8, 2, generator=g), pad_id=0).to(GPU.device)


def test_packed_varlen_is_as_close_to_float32_as_padded_sdpa(shaped):
    padded = load_policy(str(shaped), torch.bfloat16, GPU)
    varlen = load_policy(str(shaped), torch.bfloat16, GPU, attention="varlen")
    exact = copy.deepcopy(padded).float()
    assert use_packing("auto", varlen) and varlen.config._attn_implementation == varlen_attention.NAME
    batch = ragged(SMOLLM2_135M["vocab_size"])
    on = batch.mask.bool()
    with torch.no_grad():
        reference = sequence_logprobs(exact, batch, 1.0)[0][on].double()
        padded_error = (sequence_logprobs(padded, batch, 1.0)[0][on].double() - reference).abs().mean()
        packed_error = (sequence_logprobs(varlen, batch, 1.0, packed=True)[0][on].double() - reference).abs().mean()
    assert packed_error <= 1.5 * padded_error + 1e-6, f"packed {packed_error:.4f} against padded {padded_error:.4f}"

    def gradient(model, packed: bool) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        logp = sequence_logprobs(model, batch, 1.0, packed=packed)[0]
        (logp * batch.mask).sum().backward()
        return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])

    ours, theirs = gradient(varlen, True), gradient(padded, False)
    assert torch.isfinite(ours).all()
    cosine = float(torch.nn.functional.cosine_similarity(ours, theirs, dim=0))
    assert cosine > 0.99, f"the packed gradient points elsewhere: cosine {cosine:.4f}"
