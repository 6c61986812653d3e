"""Log-probabilities chunk by chunk (learning/token_logprobs.py): the same values and gradients as
the whole logits through grpo.logprobs_and_entropy, and memory that grows with the chunk, not
with sequences x length x vocabulary.

Memory is measured by what is created and kept, not by timing or by an allocator's statistics
(the CPU has none): a TorchDispatchMode sees every tensor an operation creates, forward and
backward; saved-tensor hooks see every tensor the autograd graph keeps for the backward pass.
The model has a vocabulary (1,000) unlike every other dimension (hidden 32, intermediate 64), so
a tensor of vocabulary width is a tensor of logits (or of their softmax, exp, gradient...).
Views and in-place results (outputs that share an input's storage) and the weights are not new
memory and are not counted.

Rounding: chunks change no reduction (each position's log-softmax is one reduction over the
vocabulary either way), only the kernels' shapes; values and gradients are compared within
2 gamma_n (n the longest reduction; see test_sequence_logprobs.py's docstring), and those of
the same logits with chunks of any size within 2 gamma_V."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainer_svc.config import LoraConfig
from trainer_svc.learning import token_logprobs
from trainer_svc.learning.batch import collate
from trainer_svc.learning.grpo import logprobs_and_entropy
from trainer_svc.learning.lora import AdapterDisabled, with_adapter
from trainer_svc.learning.token_logprobs import causal_lm, chunked_logprobs, fusable, sequence_logprobs
from trainer_svc.rollout_types import Group, Sample

VOCAB = 1000
TEMPERATURE = 0.7
UNIT_ROUNDOFF = 2.0**-24  # float32
CHUNK = 8  # rows a chunk in the memory tests; the batch has 60 generated positions


def gamma2(n: int) -> float:
    return 2 * n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)


def relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.detach().double() - theirs.detach().double()).norm() / theirs.detach().double().norm())


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
    )  # fmt: skip
    lm = LlamaForCausalLM(config)
    lm.config.use_cache = False
    return lm


def batch_of(lengths=((4, (12, 9)), (7, (3, 10)), (5, (0, 14)), (6, (8, 4)))):
    """Prompts of 4 to 7 tokens, completions of 0 to 14 (60 generated positions in all)."""
    g = torch.Generator().manual_seed(11)
    groups = []
    for prompt_len, completions in lengths:
        prompt = torch.randint(3, VOCAB, (prompt_len,), generator=g).tolist()
        samples = [
            Sample(torch.randint(3, VOCAB, (n,), generator=g).tolist(), [-1.0] * n, "", "length") for n in completions
        ]
        groups.append(Group(prompt, samples))
    return collate(groups, torch.randn(len(groups), 2, generator=g), pad_id=0)


def whole_logits_logprobs(model, batch):
    """The trainer's math before: the model's logits of every position, upcast at once."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    return logprobs_and_entropy(logits, batch.targets, TEMPERATURE)


def backward_of(logp, batch) -> None:
    weights = batch.mask * torch.linspace(-1, 1, batch.mask.numel()).view_as(batch.mask)
    (logp * weights).sum().backward()


def gradients(model, compute, batch) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    backward_of(compute()[0], batch)
    return [p.grad.clone() for p in model.parameters()]


def parameter_storages(model) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


class LargestLogits(TorchDispatchMode):
    """The most positions of any vocabulary-wide tensor an operation creates (views, in-place
    results and the weights left out)."""

    def __init__(self, weights: set[int]):
        super().__init__()
        self.weights, self.rows = weights, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == VOCAB:
                storage = t.untyped_storage().data_ptr()
                if storage not in inputs and storage not in self.weights:
                    self.rows = max(self.rows, t.numel() // VOCAB)
        return out


def largest_logits(model, compute, batch) -> int:
    model.zero_grad(set_to_none=True)
    with LargestLogits(parameter_storages(model)) as probe:
        backward_of(compute()[0], batch)
    return probe.rows


def logits_kept_for_backward(model, compute) -> list[tuple[int, ...]]:
    """Shapes of the vocabulary-wide tensors the graph keeps for the backward pass."""
    kept, weights = [], parameter_storages(model)

    def pack(t):
        if t.dim() >= 1 and t.shape[-1] == VOCAB and t.untyped_storage().data_ptr() not in weights:
            kept.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compute()
    return kept


def test_no_tensor_holds_more_than_one_chunk_of_logits(model):
    batch = batch_of()
    generated, positions = int(batch.mask.sum()), batch.mask.numel()
    assert generated == 60
    chunked = largest_logits(model, lambda: sequence_logprobs(model, batch, TEMPERATURE, chunk=CHUNK), batch)
    assert chunked == CHUNK
    # The probe sees the whole batch's logits where they are made (so the test can fail):
    assert largest_logits(model, lambda: whole_logits_logprobs(model, batch), batch) >= positions


def test_no_logits_are_kept_for_the_backward_pass(model):
    batch = batch_of()
    assert logits_kept_for_backward(model, lambda: sequence_logprobs(model, batch, TEMPERATURE, chunk=CHUNK)) == []
    whole = logits_kept_for_backward(model, lambda: whole_logits_logprobs(model, batch))
    assert tuple(batch.targets.shape) + (VOCAB,) in whole  # the float32 logits the old math kept


@pytest.mark.parametrize("chunk", [1, 7, CHUNK, 60, None])
def test_chunked_values_and_gradients_equal_the_whole_logits(model, chunk):
    batch = batch_of()
    on = batch.mask.bool()
    ours = sequence_logprobs(model, batch, TEMPERATURE, chunk=chunk)
    theirs = whole_logits_logprobs(model, batch)
    bound = gamma2(max(VOCAB, int(batch.mask.numel())))
    assert relative_difference(ours[0][on], theirs[0][on]) <= bound
    assert relative_difference(ours[1][on], theirs[1][on]) <= bound
    assert (ours[0][~on] == 0).all() and (ours[1][~on] == 0).all()
    for a, b in zip(
        gradients(model, lambda: sequence_logprobs(model, batch, TEMPERATURE, chunk=chunk), batch),
        gradients(model, lambda: whole_logits_logprobs(model, batch), batch),
        strict=True,
    ):
        assert relative_difference(a, b) <= bound


def test_models_outside_the_fused_list_chunk_their_own_logits(model, monkeypatch):
    """A model whose logits are more than its head's output: the model makes them, the float32
    math still goes chunk by chunk and gives the same values and gradients."""
    batch = batch_of()
    monkeypatch.setattr(token_logprobs, "FUSED_MODEL_TYPES", frozenset())
    assert not fusable(model)
    on = batch.mask.bool()
    bound = gamma2(max(VOCAB, int(batch.mask.numel())))
    compute = lambda: sequence_logprobs(model, batch, TEMPERATURE, chunk=CHUNK)  # noqa: E731
    assert relative_difference(compute()[0][on], whole_logits_logprobs(model, batch)[0][on]) <= bound
    whole = lambda: whole_logits_logprobs(model, batch)  # noqa: E731
    for a, b in zip(gradients(model, compute, batch), gradients(model, whole, batch), strict=True):
        assert relative_difference(a, b) <= bound
    float32_kept = [s for s in logits_kept_for_backward(model, compute) if len(s) == 2]
    assert float32_kept == []  # the model's own [N, K, V] logits stay; no float32 [rows, V] copy does


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_chunked_math_equals_the_whole_on_the_same_logits(chunk):
    g = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(23, VOCAB, generator=g)).requires_grad_()
    tokens = torch.randint(0, VOCAB, (23,), generator=g)
    upstream = torch.randn(23, generator=g)
    logp, entropy = chunked_logprobs(logits, lambda rows: rows, tokens, TEMPERATURE, chunk)
    (grad,) = torch.autograd.grad((logp * upstream).sum(), logits)
    whole_logp, whole_entropy = logprobs_and_entropy(logits, tokens, TEMPERATURE)
    (whole_grad,) = torch.autograd.grad((whole_logp * upstream).sum(), logits)
    bound = gamma2(VOCAB)
    assert relative_difference(logp, whole_logp) <= bound and relative_difference(entropy, whole_entropy) <= bound
    assert relative_difference(grad, whole_grad) <= bound
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        chunked_logprobs(logits, lambda rows: rows, tokens, TEMPERATURE, 0)


def test_a_micro_batch_with_nothing_generated_still_has_a_gradient_path(model):
    batch = batch_of(((4, (0, 0)), (5, (0, 0))))
    logp, entropy = sequence_logprobs(model, batch, TEMPERATURE, chunk=CHUNK)
    assert logp.shape == batch.targets.shape and (logp == 0).all() and (entropy == 0).all()
    model.zero_grad(set_to_none=True)
    logp.sum().backward()  # as an FSDP2 rank's empty micro-batch must: every rank runs the backward
    assert model.lm_head.weight.grad is not None and (model.lm_head.weight.grad == 0).all()


def test_the_adapter_off_reference_of_a_lora_policy_is_fused(model):
    """The KL reference of a LoRA run is the policy with its adapter switched off: its logits
    come from the base model's head, chunk by chunk, equal to the base's own."""
    import copy

    policy = with_adapter(copy.deepcopy(model), LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]), seed=1)
    reference = AdapterDisabled(policy)
    assert causal_lm(reference) is causal_lm(policy) and fusable(causal_lm(reference))
    batch = batch_of()
    on = batch.mask.bool()
    with torch.no_grad():
        ours = sequence_logprobs(reference, batch, TEMPERATURE, chunk=CHUNK)[0]
        theirs = whole_logits_logprobs(model, batch)[0]
    assert relative_difference(ours[on], theirs[on]) <= gamma2(max(VOCAB, int(batch.mask.numel())))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_one_pass_gradient_equals_autograds(dtype):
    """grpo.logprob_grad against autograd through grpo.logprobs_and_entropy, in the logits' dtype:
    within 2 gamma_V in float64 terms, and within one bf16 rounding (2^-8 relative) for bf16."""
    from trainer_svc.learning.grpo import logprob_grad, logprob_stats

    g = torch.Generator().manual_seed(9)
    logits = (3 * torch.randn(17, VOCAB, generator=g)).to(dtype).requires_grad_()
    tokens = torch.randint(0, VOCAB, (17,), generator=g)
    upstream = torch.randn(17, generator=g, dtype=torch.float64).to(torch.promote_types(dtype, torch.float32))
    logp, entropy = logprobs_and_entropy(logits, tokens, TEMPERATURE)
    (expected,) = torch.autograd.grad((logp * upstream).sum(), logits)
    stats_logp, stats_entropy, lse = logprob_stats(logits, tokens, TEMPERATURE)
    assert torch.equal(stats_logp, logp.detach()) and torch.equal(stats_entropy, entropy)
    ours = logprob_grad(logits.detach(), tokens, lse, upstream, TEMPERATURE)
    assert ours.dtype == dtype
    bound = gamma2(VOCAB) if dtype == torch.float64 else 2.0**-8
    assert relative_difference(ours, expected) <= bound
