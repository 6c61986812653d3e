"""transformers' greedy decoding and token logprobs, to check the engine against."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=8)
def _load(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


class Reference:
    def _load(self, model_dir: str):
        return _load(model_dir)

    def tokenizer(self, model_dir: Path):
        return self._load(str(model_dir))[1]

    def greedy(self, model_dir: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Argmax decoding, stopping after the end-of-sequence token as vLLM does."""
        import torch

        model, tokenizer = self._load(str(model_dir))
        ids = list(prompt_ids)
        out = []
        with torch.no_grad():
            for _ in range(max_tokens):
                token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                out.append(token)
                ids.append(token)
                if token == tokenizer.eos_token_id:
                    break
        return out

    def token_logprobs(
        self, model_dir: Path, prompt_ids: list[int], generated: list[int], temperature: float
    ) -> list[float]:
        """log p(token) under softmax(logits / temperature), for each generated token."""
        import torch

        model, _ = self._load(str(model_dir))
        with torch.no_grad():
            logits = model(torch.tensor([list(prompt_ids) + list(generated)])).logits[0].double()
        steps = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(generated)] / temperature
        logprobs = torch.log_softmax(steps, dim=-1)
        return [float(logprobs[i, t]) for i, t in enumerate(generated)]
