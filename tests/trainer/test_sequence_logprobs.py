"""The trainer's log-probabilities of a micro-batch (train_step.sequence_logprobs): logits only
at the positions whose token was generated, chunk by chunk, and the compiled path (model.compile = "on"), each equal
to the plain full forward of the model, in value and in gradient.

Equal within float32 rounding, bounded as follows. Both paths compute the same sums in other
orders (other kernels, fused or not). A float32 sum of n products is within gamma_n = n u / (1 - n u)
of the exact one, relative to the sum of the products' magnitudes (u = 2^-24, the unit roundoff;
Higham, "Accuracy and Stability of Numerical Algorithms", 3.1), so two evaluations differ by at
most 2 gamma_n, n being the longest reduction in the model (its hidden, intermediate or
vocabulary size, or the tokens a weight gradient sums over). The bound is taken per tensor in
norm (elements near zero carry the rounding of their large neighbours), and for log-probabilities
relative to their largest magnitude. The processor decides how far inside the bound a run lands,
never whether it does."""

from __future__ import annotations

import copy

import pytest
import torch

from trainer_svc.distributed import Distributed
from trainer_svc.learning.batch import collate
from trainer_svc.learning.grpo import logprobs_and_entropy
from trainer_svc.learning.model import compile_layers, load_policy
from trainer_svc.learning.train_step import sequence_logprobs
from trainer_svc.rollout_types import Group, Sample

TEMPERATURE = 0.8
UNIT_ROUNDOFF = 2.0**-24  # float32


def rounding_bound(model, batch) -> float:
    """2 gamma_n for the longest reduction n of this model on this batch (see the docstring)."""
    config = model.config
    n = max(config.hidden_size, config.intermediate_size, config.vocab_size, int(batch.mask.numel()))
    return 2 * n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)


def assert_within(ours: torch.Tensor, theirs: torch.Tensor, bound: float) -> None:
    """|ours - theirs| <= bound x |theirs| in norm (for log-probabilities: in max norm)."""
    difference = float((ours.double() - theirs.double()).norm())
    scale = float(theirs.double().norm())
    assert difference <= bound * scale, f"differ by {difference:.3e}, float32 bound {bound * scale:.3e}"


def assert_logprobs_within(ours: torch.Tensor, theirs: torch.Tensor, bound: float) -> None:
    difference = float((ours.double() - theirs.double()).abs().max())
    scale = max(1.0, float(theirs.double().abs().max()))
    assert difference <= bound * scale, f"differ by {difference:.3e}, float32 bound {bound * scale:.3e}"


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


@pytest.mark.parametrize("chunk", [1, 4, None])
def test_logits_are_taken_only_where_a_sequence_generated(policy, chunk):
    """The output projection sees the generated positions alone, a chunk of rows at a time (None:
    the default chunk, here all of them at once), and the result equals the full forward's."""
    batch = ragged_batch()
    seen = []
    hook = policy.lm_head.register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    try:
        logp, entropy = sequence_logprobs(policy, batch, TEMPERATURE, chunk=chunk)
    finally:
        hook.remove()
    generated = int(batch.mask.sum())
    vocab = policy.config.vocab_size
    assert sum(rows for rows, _ in seen) == generated and all(width == vocab for _, width in seen)
    assert max(rows for rows, _ in seen) == min(chunk or generated, generated)
    reference = full_forward_logprobs(policy, batch)
    on = batch.mask.bool()
    bound = rounding_bound(policy, batch)
    assert_logprobs_within(logp[on], reference[on], bound)
    assert (logp[~on] == 0).all() and (entropy[~on] == 0).all() and (entropy >= 0).all()
    for ours, theirs in zip(gradients_of(policy, logp, batch), gradients_of(policy, reference, batch), strict=True):
        assert_within(ours, theirs, bound)


def test_the_compiled_layers_and_logprob_math_equal_the_eager_ones(policy):
    batch = ragged_batch()
    compiled = copy.deepcopy(policy)
    compile_layers(compiled)
    torch._dynamo.utils.counters.clear()
    eager_logp, eager_entropy = sequence_logprobs(policy, batch, TEMPERATURE)
    logp, entropy = sequence_logprobs(compiled, batch, TEMPERATURE, compiled=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # the layers and the logprob math
    bound = rounding_bound(policy, batch)
    assert_logprobs_within(logp, eager_logp, bound)
    assert_logprobs_within(entropy, eager_entropy, bound)
    pairs = zip(gradients_of(compiled, logp, batch), gradients_of(policy, eager_logp, batch), strict=True)
    for ours, theirs in pairs:
        assert_within(ours, theirs, bound)


@pytest.mark.parametrize("chunk", [4, None])
def test_a_packed_micro_batch_gives_the_padded_ones_logprobs_and_gradients(policy, chunk):
    """The sequences back to back in one row, positions restarting with each (train.packing): the
    per-token log-probabilities, entropies and gradients equal the padded batch's within the
    float32 bound above; sequences never see each other (without the restarting positions the
    model would read one long sequence, and the test would fail by far more than rounding)."""
    batch = ragged_batch()
    padded_logp, padded_entropy = sequence_logprobs(policy, batch, TEMPERATURE, chunk=chunk)
    logp, entropy = sequence_logprobs(policy, batch, TEMPERATURE, chunk=chunk, packed=True)
    on = batch.mask.bool()
    bound = rounding_bound(policy, batch)
    assert_logprobs_within(logp[on], padded_logp[on], bound)
    assert_logprobs_within(entropy[on], padded_entropy[on], bound)
    assert (logp[~on] == 0).all()
    pairs = zip(gradients_of(policy, logp, batch), gradients_of(policy, padded_logp, batch), strict=True)
    for ours, theirs in pairs:
        assert_within(ours, theirs, bound)


def test_packing_is_automatic_only_with_varlen_attention(policy):
    from trainer_svc.learning.token_logprobs import use_packing

    assert policy.config._attn_implementation == "sdpa"
    assert not use_packing("auto", policy) and use_packing("on", policy) and not use_packing("off", policy)
    varlen = copy.deepcopy(policy)
    varlen.config._attn_implementation = "flash_attention_2"
    assert use_packing("auto", varlen)
