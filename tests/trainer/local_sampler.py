"""A deterministic stand-in for the rollout service, for trainer tests that need exact
repeatability (resume, rank splits): samples with transformers from the named weights, seeded
by the request's seed, and reports the sampling logprobs as the engine would.

`submit` only records the call (in `submitted`); `collect` samples it then, through `sample`, so
subclasses that change `sample` change both paths. A ticket restored after a relaunch samples the
same groups as the original would have."""

from __future__ import annotations

from dataclasses import replace

import torch

from protocol.weight_slots import SLOT_DATA, combine_sums, is_slot, read_slot_manifest, word_sum
from trainer_svc.rollout_types import Group, Sample, Ticket


def _from_slot(slot: str, content_id: str | None):
    """The model a weight slot holds, as a worker would load it: refused when the slot holds other
    weights than the request names, and checked against its checksum."""
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    manifest = read_slot_manifest(slot)
    if content_id is not None and manifest.content_id != content_id:
        raise RuntimeError(f"{slot} holds {manifest.content_id}, the request names {content_id}")
    data = (Path(slot) / SLOT_DATA).read_bytes()[: manifest.bytes]
    assert combine_sums([word_sum(data)]) == manifest.checksum, slot
    state = {
        name: torch.frombuffer(bytearray(data[e.offset : e.offset + e.nbytes]), dtype=getattr(torch, e.dtype))
        .view(e.shape)
        .float()
        for name, e in manifest.tensors.items()
    }
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(slot), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


def _from_adapter(adapter_dir: str, manifest):
    """A LoRA publish on the base its manifest names, as a worker serves it: PEFT applies the
    adapter (PEFT's loader reads the trainer's files as its own); the base is checked by content id."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from protocol.weights_dir import weights_content_id

    assert weights_content_id(manifest.base_model) == manifest.adapter.base_content_id, adapter_dir
    base = AutoModelForCausalLM.from_pretrained(manifest.base_model, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir)


class TorchSampler:
    def __init__(self, cfg, launch_id: str = "test"):
        self.cfg = cfg
        self._cache: dict[tuple[str, str | None], tuple] = {}
        self.requests: list[dict] = []
        self.submitted: list[Ticket] = []
        self.restored: list[Ticket] = []
        self.closed = False

    def _load(self, weights_dir: str, content_id: str | None):
        key = (weights_dir, content_id)
        if key not in self._cache:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from protocol.weights_dir import declared_content_id, read_manifest

            adapter = read_manifest(weights_dir) if declared_content_id(weights_dir) else None
            adapter = adapter if adapter is not None and adapter.adapter is not None else None
            if is_slot(weights_dir):
                model = _from_slot(weights_dir, content_id)
            elif adapter is not None:
                model = _from_adapter(weights_dir, adapter)
            else:
                model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=torch.float32)
            tokenizer_dir = adapter.base_model if adapter is not None else weights_dir
            self._cache = {key: (model.eval(), AutoTokenizer.from_pretrained(tokenizer_dir))}
        return self._cache[key]

    @torch.no_grad()
    def sample(self, prompts, *, weights, step, attempt, seed, n=None, temperature=None, tag="train"):
        self.requests.append(
            {"weights_dir": weights.dir, "content_id": weights.content_id, "step": step, "attempt": attempt, "tag": tag}
        )
        model, tokenizer = self._load(weights.dir, weights.content_id)
        r = self.cfg.rollout
        generator = torch.Generator().manual_seed(seed)
        groups = []
        for prompt in prompts:
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            samples = []
            for _ in range(n or r.samples_per_prompt):
                ids, tokens, logprobs, reason = list(prompt_ids), [], [], "length"
                for _ in range(r.max_tokens):
                    t = r.temperature if temperature is None else temperature
                    logits = model(torch.tensor([ids])).logits[0, -1].double()
                    probs = torch.softmax(logits / max(t, 1e-6), -1)
                    token = int(probs.argmax()) if t == 0 else int(torch.multinomial(probs, 1, generator=generator))
                    tokens.append(token)
                    logprobs.append(float(torch.log(probs[token])))
                    ids.append(token)
                    if token == tokenizer.eos_token_id:
                        reason = "stop"
                        break
                samples.append(Sample(tokens, logprobs, tokenizer.decode(tokens, skip_special_tokens=True), reason))
            groups.append(Group(prompt_ids, samples))
        return groups

    def submit(self, call: Ticket) -> Ticket:
        ticket = replace(call, parts=(len(call.prompts),))
        self.submitted.append(ticket)
        return ticket

    def restore(self, ticket: Ticket) -> None:
        self.restored.append(ticket)

    def collect(self, ticket: Ticket) -> list[Group]:
        groups = self.sample(
            list(ticket.prompts),
            weights=ticket.weights,
            step=ticket.step,
            attempt=ticket.attempt,
            seed=ticket.seed,
            n=ticket.n,
            temperature=ticket.temperature,
            tag=ticket.tag,
        )
        for group in groups:
            group.weights_step = ticket.weights_step
        return groups

    def close(self) -> None:
        self.closed = True
        self._cache.clear()
