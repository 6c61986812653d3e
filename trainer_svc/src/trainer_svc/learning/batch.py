"""From rollout groups to padded tensors, and the split of one step into ranks and micro-batches.

Micro-batches are cut by a token budget, not by a count: a micro-batch's memory grows with its
padded tokens (sequences x the longest of them), so with sequences sorted by length a budget
packs many short sequences together and puts long ones in smaller groups. The step's loss does
not change with the split (its denominators are the whole step's: grpo.token_weights).

Sequence i is prompt_i + completion_i, right-padded. `completion_mask[i, t]` marks the
positions whose *token* was generated; the logits predicting token t sit at position t - 1,
so `targets` are the inputs shifted left by one and masks are shifted the same way. A
multi-turn sample's completion holds environment turns too (Sample.loss_mask): their positions
have mask 0, so every loss weight, count and correction leaves them out (their gradient is 0).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..rollout_types import Group


@dataclass
class Batch:
    input_ids: torch.Tensor  # [N, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [N, L] 1 on real tokens
    targets: torch.Tensor  # [N, L - 1] input_ids shifted left: the token each position predicts
    mask: torch.Tensor  # [N, L - 1] 1 where the predicted token was generated (loss positions)
    rollout_logprobs: torch.Tensor  # [N, L - 1] the engine's sampling logprobs at those positions
    advantages: torch.Tensor  # [N] one per sequence

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: slice | torch.Tensor) -> Batch:
        return Batch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def by_length(self) -> Batch:
        """The same sequences, shortest first: micro-batches cut from it then hold sequences of
        similar lengths, and trimmed() drops more padding. (A step's loss is a sum over its
        sequences, so their order changes nothing but the rounding of sums.)"""
        order = torch.argsort(self.attention_mask.sum(dim=1), stable=True)
        return self.select(order)

    def trimmed(self) -> Batch:
        """The same sequences without the padding columns no sequence of this batch reaches
        (a step's batch is padded to its longest sequence; a micro-batch's may be shorter).
        Right padding and causal attention: the real tokens' logits do not change."""
        width = max(int(self.attention_mask.sum(dim=1).max()), 2)
        if width >= self.input_ids.shape[1]:
            return self
        return Batch(
            self.input_ids[:, :width],
            self.attention_mask[:, :width],
            self.targets[:, : width - 1],
            self.mask[:, : width - 1],
            self.rollout_logprobs[:, : width - 1],
            self.advantages,
        )

    def to(self, device: torch.device) -> Batch:
        return Batch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def collate(groups: list[Group], advantages: torch.Tensor, pad_id: int) -> Batch:
    """`advantages`: [P, G], aligned with groups[p].samples[g]."""
    rows, gen_lengths, prompt_lengths, rollout_lps, seq_adv, loss_masks = [], [], [], [], [], []
    for p, group in enumerate(groups):
        for g, sample in enumerate(group.samples):
            rows.append(group.prompt_ids + sample.token_ids)
            prompt_lengths.append(len(group.prompt_ids))
            gen_lengths.append(len(sample.token_ids))
            rollout_lps.append(sample.logprobs)
            seq_adv.append(float(advantages[p, g]))
            loss_masks.append(sample.loss_mask)
    n, width = len(rows), max(len(r) for r in rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width - 1), dtype=torch.float32)
    rollout = torch.zeros((n, width - 1), dtype=torch.float32)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        start, end = prompt_lengths[i] - 1, prompt_lengths[i] - 1 + gen_lengths[i]
        mask[i, start:end] = 1.0 if loss_masks[i] is None else torch.tensor(loss_masks[i], dtype=torch.float32)
        if rollout_lps[i]:
            rollout[i, start:end] = torch.tensor(rollout_lps[i], dtype=torch.float32)
    return Batch(
        input_ids, attention, input_ids[:, 1:].clone(), mask, rollout, torch.tensor(seq_adv, dtype=torch.float32)
    )


def rank_share(batch: Batch, rank: int, world_size: int) -> Batch:
    """This rank's contiguous share of the step's sequences (the count divides evenly: a gate
    checks prompts_per_step x G against world_size x grad_accum at launch)."""
    if len(batch) % world_size:
        raise ValueError(f"{len(batch)} sequences cannot be shared evenly by {world_size} ranks")
    per_rank = len(batch) // world_size
    return batch.select(slice(rank * per_rank, (rank + 1) * per_rank))


def micro_batches(batch: Batch, count: int) -> list[Batch]:
    size = -(-len(batch) // count)
    return [batch.select(slice(i, i + size)) for i in range(0, len(batch), size)]


def padded_tokens(batch: Batch) -> int:
    """What a micro-batch costs the model's forward: its sequences x the longest of them."""
    return len(batch) * int(batch.attention_mask.sum(dim=1).max()) if len(batch) else 0


def _budget_cuts(lengths: list[int], budget: int | None) -> list[int]:
    """Where each micro-batch of sequences of `lengths` (ascending) starts when each holds at most
    `budget` padded tokens; a sequence longer than the budget alone makes one. None: one."""
    cuts, held = [0], 0
    for i, length in enumerate(lengths):  # ascending: the newest sequence is the longest of its micro-batch
        if budget is not None and held and (held + 1) * length > budget:
            cuts.append(i)
            held = 0
        held += 1
    return cuts


def budget_count(batch: Batch, budget: int | None) -> int:
    """How many micro-batches `batch` (sorted by length, shortest first) needs so that each holds at
    most `budget` padded tokens; a sequence longer than the budget alone makes one. None: 1."""
    return len(_budget_cuts(batch.attention_mask.sum(dim=1).tolist(), budget)) if len(batch) else 1


def token_budget_split(batch: Batch, budget: int | None, count: int) -> list[Batch]:
    """Exactly `count` micro-batches of `batch` (sorted by length, shortest first), each within
    `budget` padded tokens where `count` >= budget_count(batch, budget) (ranks under FSDP agree on
    the largest count, so some split further than their own sequences need). Contiguous runs of
    the sorted sequences, each trimmed of the padding none of its sequences reaches."""
    if count > len(batch):
        raise ValueError(f"{len(batch)} sequences cannot make {count} micro-batches")
    lengths = batch.attention_mask.sum(dim=1).tolist()
    cuts = _budget_cuts(lengths, budget)
    spans = [[a, b] for a, b in zip(cuts, [*cuts[1:], len(batch)], strict=True)]

    def cost(span: list[int]) -> tuple[int, int]:  # padded tokens (the last is the longest), sequences
        a, b = span
        return ((b - a) * lengths[b - 1] if b - a > 1 else 0, b - a)

    while len(spans) < count:  # halve the costliest micro-batch: the peak only goes down
        widest = max(range(len(spans)), key=lambda k: cost(spans[k]))
        a, b = spans[widest]
        middle = (a + b) // 2
        spans[widest : widest + 1] = [[a, middle], [middle, b]]
    if len(spans) > count:
        raise ValueError(f"the budget of {budget} tokens needs {len(spans)} micro-batches, not {count}")
    return [batch.select(slice(a, b)).trimmed() for a, b in spans]


@dataclass
class Packed:
    """A micro-batch's sequences back to back in one row, without padding: `input_ids` and
    `position_ids` [1, T] (positions restart at 0 with each sequence, which is how the model's
    attention tells them apart), `targets` and `mask` [1, T - 1]; `cu_seq_lens` [N + 1] int32
    (where each sequence begins, then T) and `max_length` (the longest), which varlen attention
    kernels take instead of a mask. The generated positions of the
    packed row, in order, are those of the padded batch in row-major order, so a per-position
    result over `mask` goes back with `padded_mask.masked_scatter`."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    cu_seq_lens: torch.Tensor
    max_length: int


def pack(batch: Batch) -> Packed:
    """`batch` (right-padded) as one packed row (Packed). The last position of each sequence
    predicts the next sequence's first token: it is never a generated position."""
    lengths = batch.attention_mask.sum(dim=1)  # [N]
    real = batch.attention_mask.bool()  # [N, L]
    input_ids = batch.input_ids[real].unsqueeze(0)  # [1, T]
    starts = torch.cumsum(lengths, dim=0) - lengths  # [N] where each sequence begins
    total, longest = (int(x) for x in torch.stack([lengths.sum(), lengths.max()]).tolist())  # one read
    flat = torch.arange(total, device=lengths.device)
    position_ids = (flat - torch.repeat_interleave(starts, lengths)).unsqueeze(0)  # [1, T]
    # A sequence's n - 1 predicting positions, then the boundary (0), except after the last one.
    mask_rows = torch.cat([batch.mask, torch.zeros_like(batch.mask[:, :1])], dim=1)  # [N, L]: a 0 after the end
    mask = mask_rows[real]  # [T]: position t of a sequence predicts its token t + 1 (0 at its last token)
    cu_seq_lens = torch.cat([starts, lengths.sum().reshape(1)]).to(torch.int32)  # [N + 1]
    return Packed(input_ids, position_ids, input_ids[:, 1:].clone(), mask[:-1].unsqueeze(0), cu_seq_lens, longest)
