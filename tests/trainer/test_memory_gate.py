"""The memory gate's arithmetic and refusal on the CPU, with the device's measurement given as a
line (bytes = fixed + per_token x tokens, as a training pass's peak grows with the micro-batch's
sequences of the longest length); the GPU tier runs it on a device (tests/gpu/test_memory_gate_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_config
from transformers import AutoTokenizer

from trainer_svc.distributed import Distributed
from trainer_svc.learning.model import load_policy
from trainer_svc.learning.train_step import Policy, make_optimizer, make_scheduler
from trainer_svc.rails.gates import GateRefused
from trainer_svc.rails.memory_gate import AUTO_MAX_TOKENS, SHARE, check_memory, longest_sequence

CPU = Distributed(rank=0, world_size=1, device=torch.device("cpu"))


@pytest.fixture
def policy(warm_model):
    model = load_policy(str(warm_model), torch.float32, CPU, activation_checkpointing=False, compiled=False)
    cfg = make_config(warm_model.parent / "gate-run", warm_model)
    optimizer = make_optimizer(model, cfg)
    return Policy(model, None, optimizer, make_scheduler(optimizer, cfg), 0)


def test_the_longest_sequence_is_the_longest_prompt_and_max_tokens(warm_model, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(warm_model)
    cfg = make_config(tmp_path / "run", warm_model, rollout={"max_tokens": 100})
    prompts = ["1+1=", "12+34=", "7+8="]
    longest = max(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert longest_sequence(cfg, tokenizer, prompts) == (longest, longest + 100)
    # An episode's sequence: up to env.max_episode_tokens.
    episodes = make_config(tmp_path / "run", warm_model, rollout={"max_tokens": 100}, env={"class": "m:E"})
    assert longest_sequence(episodes, tokenizer, prompts) == (longest, episodes.env.max_episode_tokens)


def test_on_a_cpu_nothing_is_probed_and_the_budget_stays_the_configs(policy, warm_model, tmp_path):
    cfg = make_config(tmp_path / "run", warm_model)
    tokenizer = AutoTokenizer.from_pretrained(warm_model)
    figures = check_memory(cfg, CPU, policy, tokenizer, ["1+1="])
    assert "skipped" in figures and cfg.train.max_tokens_per_micro_batch is None


def test_the_budget_is_set_from_the_measured_cost_of_a_token(policy, warm_model, tmp_path):
    import os

    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # a CPU's measure is against RAM
    per_token, fixed = available / 10_000, 2**20  # room for fewer tokens than AUTO_MAX_TOKENS
    cfg = make_config(tmp_path / "run", warm_model, rollout={"max_tokens": 100})
    tokenizer = AutoTokenizer.from_pretrained(warm_model)
    longest = longest_sequence(cfg, tokenizer, ["1+1="])[1]
    line = lambda sequences: fixed + per_token * longest * sequences  # noqa: E731
    figures = check_memory(cfg, CPU, policy, tokenizer, ["1+1="], measure=line)
    trainable = sum(p.numel() for p in policy.model.parameters())
    expected = int(SHARE * (available - 8 * trainable - fixed) / per_token)
    assert cfg.train.max_tokens_per_micro_batch == figures["max_tokens_per_micro_batch"]
    assert abs(cfg.train.max_tokens_per_micro_batch - expected) <= 1
    given = make_config(tmp_path / "given", warm_model, train={"max_tokens_per_micro_batch": 64})
    check_memory(given, CPU, policy, tokenizer, ["1+1="], measure=line)
    assert given.train.max_tokens_per_micro_batch == 64  # the config's own stays


def test_a_longest_sequence_that_cannot_fit_is_refused_with_the_figures_and_what_to_change(
    policy, warm_model, tmp_path
):
    import os

    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cfg = make_config(tmp_path / "run", warm_model, rollout={"max_tokens": 4000})
    tokenizer = AutoTokenizer.from_pretrained(warm_model)
    with pytest.raises(GateRefused) as refused:
        check_memory(cfg, CPU, policy, tokenizer, ["1+1="], measure=lambda sequences: sequences * available)
    message = str(refused.value)
    assert "launch gate 'memory'" in message and "rollout.max_tokens = 4000" in message
    assert "model.activation_checkpointing = true" in message and "GiB are free" in message

    def runs_out(sequences):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(GateRefused, match="ran out of memory"):
        check_memory(cfg, CPU, policy, tokenizer, ["1+1="], measure=runs_out)


def test_when_two_longest_sequences_do_not_fit_a_micro_batch_holds_one(policy, warm_model, tmp_path):
    cfg = make_config(tmp_path / "run", warm_model, rollout={"max_tokens": 100})
    tokenizer = AutoTokenizer.from_pretrained(warm_model)

    def one_fits(sequences):
        if sequences > 1:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return 2**20

    figures = check_memory(cfg, CPU, policy, tokenizer, ["1+1="], measure=one_fits)
    assert figures["max_tokens_per_micro_batch"] == figures["longest_sequence"] == cfg.train.max_tokens_per_micro_batch


def test_an_automatic_budget_stops_where_a_bigger_micro_batch_runs_no_faster(policy, warm_model, tmp_path):
    """Memory for a million tokens a micro-batch, and the budget is AUTO_MAX_TOKENS; a longest
    sequence above that cap still gets a micro-batch of its own."""
    import os

    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tokenizer = AutoTokenizer.from_pretrained(warm_model)
    for max_tokens, expected in ((100, AUTO_MAX_TOKENS), (AUTO_MAX_TOKENS + 500, None)):
        cfg = make_config(tmp_path / f"run-{max_tokens}", warm_model, rollout={"max_tokens": max_tokens})
        longest = longest_sequence(cfg, tokenizer, ["1+1="])[1]
        line = lambda n, longest=longest: available / 10**7 * longest * n  # noqa: E731
        figures = check_memory(cfg, CPU, policy, tokenizer, ["1+1="], measure=line)
        assert figures["max_tokens_per_micro_batch"] == (expected or longest)
