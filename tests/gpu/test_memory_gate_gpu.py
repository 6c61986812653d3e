"""The memory gate on a GPU (trainer_svc.rails.memory_gate), with a model of SmolLM2-135M's shape
(random weights: memory does not depend on them) in bf16: the budget it sets keeps a real
micro-batch of that many tokens within the memory it found free, its line (through micro-batches
of one and two longest sequences) predicts that micro-batch's peak, and a process allowed too
little memory is refused before its first step."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from trainer_svc.config import Config
from trainer_svc.distributed import Distributed
from trainer_svc.learning.model import load_policy
from trainer_svc.learning.train_step import Policy, make_optimizer, make_scheduler
from trainer_svc.rails.gates import GateRefused
from trainer_svc.rails.memory_gate import _costs, check_memory, probe_peak

SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
)  # fmt: skip


def word_tokenizer():
    """A whitespace word tokenizer: the gate only counts a prompt's tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "[UNK] What is 12 + 7 ? Think step by".split()
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[UNK]")


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm2-shape")
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(torch.bfloat16).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


def make(path, tmp_path, max_tokens: int):
    import msgspec

    cfg = msgspec.convert(
        {"run": {"dir": str(tmp_path / "run")}, "model": {"path": str(path), "dtype": "bfloat16"},
         "rollout": {"max_tokens": max_tokens}},
        Config,
    )  # fmt: skip
    device = torch.device("cuda", 0)
    dist_info = Distributed(rank=0, world_size=1, device=device)
    model = load_policy(str(path), torch.bfloat16, dist_info)
    optimizer = make_optimizer(model, cfg)
    return cfg, dist_info, Policy(model, None, optimizer, make_scheduler(optimizer, cfg), 0)


def test_the_budget_keeps_a_real_micro_batch_within_the_free_memory_and_the_line_holds(shaped, tmp_path):
    cfg, dist_info, policy = make(shaped, tmp_path, max_tokens=2048)
    tokenizer = AutoTokenizer.from_pretrained(shaped)
    figures = check_memory(cfg, dist_info, policy, tokenizer, ["What is 12 + 7? Think step by step."])
    budget = cfg.train.max_tokens_per_micro_batch
    length = figures["longest_sequence"]
    assert budget == figures["max_tokens_per_micro_batch"] and budget >= length
    sequences = max(budget // length, 1)
    one, two = (probe_peak(policy, cfg, dist_info.device, length, n) for n in (1, 2))
    costs = _costs(policy, dist_info.device, length, one, two, None)
    measured = probe_peak(policy, cfg, dist_info.device, length, sequences)  # the budget's micro-batch, for real
    predicted = costs.fixed + costs.per_token * length * sequences
    assert sequences > 2 and measured + costs.optimizer <= costs.available, (measured, costs, sequences)
    # The line through one and two sequences predicts many within 10% (it may err high, not low).
    assert 0.9 * predicted <= measured <= 1.1 * predicted, (measured, predicted, sequences)


def test_a_process_allowed_too_little_memory_is_refused_before_its_first_step(shaped, tmp_path):
    cfg, dist_info, policy = make(shaped, tmp_path, max_tokens=8000)
    tokenizer = AutoTokenizer.from_pretrained(shaped)
    allocated = torch.cuda.memory_allocated(dist_info.device)
    total = torch.cuda.get_device_properties(dist_info.device).total_memory
    torch.cuda.set_per_process_memory_fraction((allocated + 2**30) / total, dist_info.device)  # 1 GiB more
    try:
        with pytest.raises(GateRefused, match="launch gate 'memory'") as refused:
            check_memory(cfg, dist_info, policy, tokenizer, ["What is 12 + 7?"])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dist_info.device)
    assert "rollout.max_tokens = 8000" in str(refused.value)
