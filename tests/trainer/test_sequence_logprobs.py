"""The trainer's log-probabilities of a micro-batch (train_step.sequence_logprobs): logits only
at the columns some sequence generated, and the compiled path (model.compile = "on"), each equal
to the plain full forward of the model, in value and in gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from trainer_svc.batch import collate
from trainer_svc.grpo import logprobs_and_entropy
from trainer_svc.model import Distributed, compile_layers, load_policy
from trainer_svc.rollout import Group, Sample
from trainer_svc.train_step import sequence_logprobs

TEMPERATURE = 0.8


def ragged_batch():
    """Prompts of 3 to 6 tokens and completions of 0 to 5: every column kind (prompt only,
    mixed, generated, padding only) occurs."""
    g = torch.Generator().manual_seed(7)
    groups = []
    for prompt_len, lengths in ((3, (5, 1)), (6, (0, 4)), (4, (2, 3))):
        prompt = torch.randint(3, 20, (prompt_len,), generator=g).tolist()
        samples = [Sample(torch.randint(3, 20, (n,), generator=g).tolist(), [-1.0] * n, "", "length") for n in lengths]
        groups.append(Group(prompt, samples))
    batch = collate(groups, torch.randn(3, 2, generator=g), pad_id=0)
    return batch


def full_forward_logprobs(model, batch):
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    return logprobs_and_entropy(logits, batch.targets, TEMPERATURE)[0]


def gradients_of(model, logp, batch) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (logp * batch.mask * torch.linspace(-1, 1, batch.mask.numel()).view_as(batch.mask)).sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.fixture(scope="module")
def policy(tiny_model):
    torch.manual_seed(0)
    return load_policy(str(tiny_model), torch.float32, Distributed(0, 1, torch.device("cpu")))


def test_logits_are_taken_only_where_a_sequence_generated(policy):
    batch = ragged_batch()
    seen = []
    hook = policy.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.shape[1]))
    try:
        logp, entropy = sequence_logprobs(policy, batch, TEMPERATURE)
    finally:
        hook.remove()
    generated_columns = int(batch.mask.any(dim=0).sum())
    assert seen == [generated_columns] and generated_columns < batch.targets.shape[1]
    reference = full_forward_logprobs(policy, batch)
    on = batch.mask.bool()
    assert_close(logp[on], reference[on], atol=1e-5, rtol=1e-5)
    assert (logp[~batch.mask.any(dim=0).expand_as(on)] == 0).all() and (entropy >= 0).all()
    for ours, theirs in zip(gradients_of(policy, logp, batch), gradients_of(policy, reference, batch), strict=True):
        assert_close(ours, theirs, atol=1e-6, rtol=1e-4)


def test_the_compiled_layers_and_logprob_math_equal_the_eager_ones(policy):
    batch = ragged_batch()
    compiled = copy.deepcopy(policy)
    compile_layers(compiled)
    torch._dynamo.utils.counters.clear()
    eager_logp, eager_entropy = sequence_logprobs(policy, batch, TEMPERATURE)
    logp, entropy = sequence_logprobs(compiled, batch, TEMPERATURE, compiled=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # the layers and the logprob math
    assert_close(logp, eager_logp, atol=1e-5, rtol=1e-5)
    assert_close(entropy, eager_entropy, atol=1e-5, rtol=1e-5)
    pairs = zip(gradients_of(compiled, logp, batch), gradients_of(policy, eager_logp, batch), strict=True)
    for ours, theirs in pairs:
        assert_close(ours, theirs, atol=1e-6, rtol=1e-4)
