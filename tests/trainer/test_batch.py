"""From rollout groups to padded tensors (checked by hand on a small case), and the split of a
step into rank shares and micro-batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_svc.learning.batch import (
    Batch,
    budget_count,
    collate,
    micro_batches,
    pack,
    padded_tokens,
    rank_share,
    token_budget_split,
)
from trainer_svc.rollout_types import Group, Sample

torch.set_num_threads(1)

PAD = 0


def sample(token_ids: list[int], logprobs: list[float]) -> Sample:
    return Sample(token_ids=token_ids, logprobs=logprobs, text="", finish_reason="stop")


def small_groups() -> list[Group]:
    """Two prompts (lengths 2 and 3), two samples each (lengths 3, 1 and 2, 4)."""
    return [
        Group([5, 6], [sample([7, 8, 9], [-0.1, -0.2, -0.3]), sample([10], [-0.4])]),
        Group([11, 12, 13], [sample([14, 15], [-0.5, -0.6]), sample([16, 17, 18, 19], [-0.7, -0.8, -0.9, -1.0])]),
    ]


ADVANTAGES = torch.tensor([[1.0, -1.0], [0.5, -0.25]])


def test_collate_by_hand():
    batch = collate(small_groups(), ADVANTAGES, PAD)
    assert torch.equal(
        batch.input_ids,
        torch.tensor(
            [
                [5, 6, 7, 8, 9, 0, 0],
                [5, 6, 10, 0, 0, 0, 0],
                [11, 12, 13, 14, 15, 0, 0],
                [11, 12, 13, 16, 17, 18, 19],
            ]
        ),
    )
    assert torch.equal(
        batch.attention_mask,
        torch.tensor(
            [
                [1, 1, 1, 1, 1, 0, 0],
                [1, 1, 1, 0, 0, 0, 0],
                [1, 1, 1, 1, 1, 0, 0],
                [1, 1, 1, 1, 1, 1, 1],
            ]
        ),
    )
    assert torch.equal(
        batch.targets,
        torch.tensor(
            [
                [6, 7, 8, 9, 0, 0],
                [6, 10, 0, 0, 0, 0],
                [12, 13, 14, 15, 0, 0],
                [12, 13, 16, 17, 18, 19],
            ]
        ),
    )
    # position t predicts token t + 1: the generated tokens are predicted from the last prompt
    # position up to the one before the last generated token
    assert torch.equal(
        batch.mask,
        torch.tensor(
            [
                [0.0, 1, 1, 1, 0, 0],
                [0.0, 1, 0, 0, 0, 0],
                [0.0, 0, 1, 1, 0, 0],
                [0.0, 0, 1, 1, 1, 1],
            ]
        ),
    )
    assert torch.equal(
        batch.rollout_logprobs,
        torch.tensor(
            [
                [0.0, -0.1, -0.2, -0.3, 0, 0],
                [0.0, -0.4, 0, 0, 0, 0],
                [0.0, 0, -0.5, -0.6, 0, 0],
                [0.0, 0, -0.7, -0.8, -0.9, -1.0],
            ]
        ),
    )
    assert torch.equal(batch.advantages, torch.tensor([1.0, -1.0, 0.5, -0.25]))  # [prompt][sample]
    assert batch.input_ids.dtype == torch.long and batch.targets.dtype == torch.long
    assert batch.mask.dtype == batch.rollout_logprobs.dtype == batch.advantages.dtype == torch.float32
    assert len(batch) == 4


def random_groups(seed: int, prompts: int, samples: int) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)

    def ints(n: int) -> list[int]:
        return torch.randint(1, 100, (n,), generator=gen).tolist()

    groups = []
    for _ in range(prompts):
        prompt = ints(int(torch.randint(1, 9, (1,), generator=gen)))
        drawn = []
        for _ in range(samples):
            ids = ints(int(torch.randint(0, 7, (1,), generator=gen)))
            drawn.append(sample(ids, (-torch.rand(len(ids), generator=gen)).tolist()))
        groups.append(Group(prompt, drawn))
    return groups


@pytest.mark.parametrize("seed", range(5))
def test_collate_invariants(seed):
    """Any lengths: the mask selects exactly the generated tokens among the targets, in order,
    with their logprobs beside them; everything past a sequence is padding."""
    groups = random_groups(seed, prompts=3, samples=4)
    advantages = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    batch = collate(groups, advantages, pad_id=PAD)
    sequences = [(g.prompt_ids, s) for g in groups for s in g.samples]
    width = max(len(p) + len(s.token_ids) for p, s in sequences)
    assert batch.input_ids.shape == (12, width) and batch.targets.shape == batch.mask.shape == (12, width - 1)
    assert batch.rollout_logprobs.shape == (12, width - 1) and batch.advantages.shape == (12,)
    assert torch.equal(batch.targets, batch.input_ids[:, 1:])
    assert torch.equal(batch.advantages, advantages.flatten())
    for i, (prompt, s) in enumerate(sequences):
        n = len(prompt) + len(s.token_ids)
        assert batch.input_ids[i, :n].tolist() == prompt + s.token_ids
        assert (batch.input_ids[i, n:] == PAD).all() and batch.attention_mask[i].tolist() == [1] * n + [0] * (width - n)
        on = batch.mask[i].bool()
        assert int(on.sum()) == len(s.token_ids)
        assert batch.targets[i][on].tolist() == s.token_ids
        assert torch.allclose(batch.rollout_logprobs[i][on], torch.tensor(s.logprobs, dtype=torch.float32))
        assert (batch.rollout_logprobs[i][~on] == 0).all()


def test_an_empty_completion_has_no_loss_positions():
    groups = [Group([3, 4, 5], [sample([], []), sample([6, 7], [-1.0, -2.0])])]
    batch = collate(groups, torch.tensor([[0.5, -0.5]]), PAD)
    assert batch.mask.tolist() == [[0, 0, 0, 0], [0, 0, 1, 1]]
    assert batch.rollout_logprobs.tolist() == [[0, 0, 0, 0], [0, 0, -1.0, -2.0]]


def numbered(n: int) -> Batch:
    """A batch whose sequence i is recognisable by its first token and advantage (i)."""
    groups = [Group([100 + i], [sample([1, 2], [-0.5, -0.5])]) for i in range(n)]
    return collate(groups, torch.arange(n, dtype=torch.float32)[:, None], PAD)


def order(parts: list[Batch]) -> list[int]:
    return [int(a) for part in parts for a in part.advantages]


@pytest.mark.parametrize("n, world", [(8, 1), (8, 2), (8, 4), (12, 3), (16, 8)])
def test_rank_shares_partition_the_step(n, world):
    batch = numbered(n)
    shares = [rank_share(batch, rank, world) for rank in range(world)]
    assert order(shares) == list(range(n))  # every sequence once, in order
    assert all(len(s) == n // world for s in shares)
    for share in shares:  # all fields are cut alike
        assert (share.input_ids[:, 0] - 100).tolist() == share.advantages.long().tolist()
        assert share.mask.shape[0] == share.targets.shape[0] == share.rollout_logprobs.shape[0] == len(share)


def test_rank_shares_never_drop_a_sequence():
    batch = numbered(9)
    try:
        shares = [rank_share(batch, rank, 2) for rank in range(2)]
    except ValueError:
        return  # refusing an uneven split is as good as covering it
    assert order(shares) == list(range(9))


@pytest.mark.parametrize("n, count", [(8, 1), (8, 2), (8, 8), (12, 4), (7, 2), (5, 3), (3, 4)])
def test_micro_batches_partition_the_share(n, count):
    batch = numbered(n)
    parts = micro_batches(batch, count)
    assert order(parts) == list(range(n))
    assert 1 <= len(parts) <= count
    assert all(len(p) >= 1 for p in parts)
    if n % count == 0:
        assert len(parts) == count and {len(p) for p in parts} == {n // count}
    for part in parts:
        assert (part.input_ids[:, 0] - 100).tolist() == part.advantages.long().tolist()


def test_select_and_to_keep_every_field():
    batch = collate(small_groups(), ADVANTAGES, PAD)
    part = batch.select(slice(1, 3)).to(torch.device("cpu"))
    assert torch.equal(part.input_ids, batch.input_ids[1:3])
    assert torch.equal(part.mask, batch.mask[1:3]) and torch.equal(part.advantages, batch.advantages[1:3])
    assert torch.equal(part.rollout_logprobs, batch.rollout_logprobs[1:3])


def ragged_batch(lengths: list[int]) -> Batch:
    """Sequences of the given lengths (prompt of 1 token, the rest generated), shortest first."""
    groups = [Group([1], [sample([2] * (n - 1), [-0.5] * (n - 1))]) for n in sorted(lengths)]
    return collate(groups, torch.zeros(len(lengths), 1), PAD)


@given(
    lengths=st.lists(st.integers(2, 40), min_size=1, max_size=24),
    budget=st.integers(2, 200),
    extra=st.integers(0, 5),
)
@settings(max_examples=200, deadline=None)
def test_a_token_budget_split_keeps_every_sequence_once_within_the_budget(lengths, budget, extra):
    batch = ragged_batch(lengths)
    needed = budget_count(batch, budget)
    count = min(needed + extra, len(batch))
    if count < needed:
        return  # more than one sequence per micro-batch would be needed than there are sequences
    micro = token_budget_split(batch, budget, count)
    assert len(micro) == count
    assert sorted(int(n) for mb in micro for n in mb.attention_mask.sum(dim=1)) == sorted(lengths)
    for mb in micro:
        assert padded_tokens(mb) <= budget or len(mb) == 1  # a sequence past the budget goes alone
        assert mb.input_ids.shape[1] == int(mb.attention_mask.sum(dim=1).max())  # trimmed


def test_a_token_budget_packs_short_sequences_together_and_long_ones_apart():
    batch = ragged_batch([4, 4, 4, 4, 16, 16])
    assert budget_count(batch, 32) == 2  # four of 4 tokens (16 padded), then two of 16 (32)
    short, long = token_budget_split(batch, 32, 2)
    assert (len(short), len(long)) == (4, 2)
    assert budget_count(batch, 16) == 3 and budget_count(batch, None) == 1
    assert [len(mb) for mb in token_budget_split(batch, 32, 4)] == [2, 2, 1, 1]  # split further: halves


@given(lengths=st.lists(st.integers(2, 12), min_size=1, max_size=8))
@settings(max_examples=100, deadline=None)
def test_a_packed_batch_holds_the_same_generated_targets_in_the_same_order(lengths):
    batch = ragged_batch(lengths)
    packed = pack(batch)
    assert packed.input_ids.shape == (1, sum(lengths)) and packed.mask.shape == (1, sum(lengths) - 1)
    starts = [sum(sorted(lengths)[:i]) for i in range(len(lengths))]
    assert [int(packed.position_ids[0, s]) for s in starts] == [0] * len(lengths)  # positions restart
    assert packed.targets[packed.mask.bool()].tolist() == batch.targets[batch.mask.bool()].tolist()
    assert int(packed.mask.sum()) == int(batch.mask.sum())
