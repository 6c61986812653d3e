"""`trainer-svc sft`: a short supervised warm-up before GRPO, as real pipelines have.

A randomly initialised model almost never answers correctly, so every GRPO group has equal
rewards and there is no gradient. The warm-up trains on `sft.problems` of the training problems
(prompt, then the gold answer and end-of-sequence; cross-entropy on the answer tokens only) and
stops as soon as sampled accuracy reaches `sft.stop_at_accuracy`: the policy then sometimes
succeeds, and the GRPO stage does the improving, including on problems the warm-up never saw.
The result is written to `model.path`, atomically, with config and tokenizer files copied byte
for byte from the base model.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import torch

from ..config import Config
from ..data import DataError, Problem, is_conversation, load_problems
from ..weights.atomic_dir import building

log = logging.getLogger(__name__)


def encode_examples(tokenizer, problems: list[Problem]) -> list[tuple[list[int], int]]:
    """(ids of prompt + gold + eos, length of the prompt part) per problem."""
    out = []
    for p in problems:
        prompt = tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
        answer = tokenizer(p.gold, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt + answer, len(prompt)))
    return out


def supervised_loss(model, examples: list[tuple[list[int], int]], pad_id: int) -> torch.Tensor:
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, prompt_len) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        labels[i, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])  # answer tokens only
    return model(input_ids=input_ids, attention_mask=attention, labels=labels).loss


@torch.no_grad()
def sampled_accuracy(model, tokenizer, problems: list[Problem], max_tokens: int, is_correct) -> float:
    """Share of problems answered correctly (`is_correct(text, gold)`) with one sample each at
    temperature 1, the way GRPO will sample them."""
    model.eval()
    tokenizer.padding_side = "left"
    batch = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(
        **batch,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train()
    return sum(is_correct(t, p.gold) for t, p in zip(texts, problems, strict=False)) / len(problems)


def run_sft(cfg: Config) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .rewards import Verifier

    sft = cfg.sft
    out = Path(cfg.model.path)
    if out.exists():
        raise FileExistsError(f"{out} exists; the warm-up writes model.path, remove it to train it again")
    torch.manual_seed(cfg.run.seed)
    rng = random.Random(cfg.run.seed)
    train_problems, _ = load_problems(cfg.data, cfg.run.seed)
    unfit = next((p for p in train_problems if p.gold is None or is_conversation(p.prompt)), None)
    if unfit is not None:
        raise DataError(
            f"row {unfit.id}: the warm-up trains on text prompts followed by their answer, and this row has "
            f"{'no answer' if unfit.gold is None else 'a conversation'}; warm up on text rows with answers"
        )
    seen = rng.sample(train_problems, min(sft.problems, len(train_problems)))
    tokenizer = AutoTokenizer.from_pretrained(sft.base)
    model = AutoModelForCausalLM.from_pretrained(sft.base, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft.lr, betas=(0.9, 0.99))
    examples = encode_examples(tokenizer, seen)
    verifier = Verifier()
    history, accuracy, step = [], 0.0, 0
    try:
        for step in range(1, sft.steps + 1):
            loss = supervised_loss(
                model, rng.sample(examples, min(sft.batch_size, len(examples))), tokenizer.pad_token_id
            )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % sft.eval_every == 0:
                probe = rng.sample(train_problems, min(sft.eval_problems, len(train_problems)))
                accuracy = sampled_accuracy(model, tokenizer, probe, cfg.rollout.max_tokens, verifier.is_correct)
                history.append({"step": step, "loss": float(loss.detach()), "sampled_accuracy": accuracy})
                log.info("sft step %d: loss %.3f, sampled accuracy %.3f", step, float(loss.detach()), accuracy)
                if accuracy >= sft.stop_at_accuracy:
                    break
    finally:
        verifier.close()
    save_model(model, Path(sft.base), out)
    report = {
        "base": sft.base,
        "out": str(out),
        "steps": step,
        "sampled_accuracy": accuracy,
        "problems_seen": len(seen),
        "history": history,
    }
    (out / "sft_report.json").write_text(json.dumps(report, indent=1))
    return report


def save_model(model, base: Path, out: Path) -> None:
    with building(out) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        for name in os.listdir(base):  # config and tokenizer exactly as the base has them
            if not name.endswith(".safetensors") and not name.endswith(".index.json") and (base / name).is_file():
                shutil.copyfile(base / name, staging / name)
