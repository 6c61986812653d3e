"""The trainer's side of the LoRA end-to-end tests, run with the trainer venv's python (PEFT and
trainer_svc live there; the e2e tests run in the rollout venv).

    python lora_trainer_side.py publish BASE PUBLISH_DIR STEP RANK SEED
        a random LoRA adapter of rank RANK on BASE (seeded, lora_B non-zero so it changes the
        model), published by the trainer's own writer (trainer_svc.weights.adapters) as
        PUBLISH_DIR/step_STEP; prints its directory and content id
    python lora_trainer_side.py logprobs ADAPTER_DIR TEMPERATURE   (stdin: [[prompt_ids, token_ids], ...])
        the trainer's logprobs of each token under the adapter: the model built as training builds
        it (learning.model.load_policy with the adapter), the adapter's tensors loaded as a resume loads them,
        the trainer's logprob math (learning.grpo.logprobs_and_entropy); prints them as JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from protocol.weights_dir import ADAPTER_WEIGHTS, read_manifest, weights_content_id
from trainer_svc.config import LoraConfig
from trainer_svc.distributed import Distributed
from trainer_svc.learning.grpo import logprobs_and_entropy
from trainer_svc.learning.model import load_policy
from trainer_svc.weights.adapters import load_adapter_tensors

ONE = Distributed(0, 1, torch.device("cpu"))


def publish(base: str, publish_dir: str, step: int, rank: int, seed: int) -> None:
    from trainer_svc.weights.adapters import publish_adapter

    torch.manual_seed(seed)
    model = load_policy(base, torch.float32, ONE, lora=LoraConfig(rank=rank, alpha=16.0))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.2)
    done = publish_adapter(
        step, model, publish_dir=Path(publish_dir), base_model=Path(base), base_content_id=weights_content_id(base),
        dist_info=ONE, run_name="lora-e2e",
    )  # fmt: skip
    print(done.path, done.content_id)


def logprobs(adapter_dir: str, temperature: float) -> None:
    from safetensors.torch import load_file

    manifest = read_manifest(adapter_dir)
    lora = LoraConfig(
        rank=manifest.adapter.rank, alpha=manifest.adapter.alpha, target_modules=manifest.adapter.target_modules
    )
    model = load_policy(manifest.base_model, torch.float32, ONE, lora=lora).eval()
    load_adapter_tensors(model, load_file(Path(adapter_dir) / ADAPTER_WEIGHTS), ONE, Path(adapter_dir))
    found = []
    with torch.no_grad():
        for prompt_ids, token_ids in json.load(sys.stdin):
            ids = torch.tensor([prompt_ids + token_ids])
            logits = model(input_ids=ids).logits[:, len(prompt_ids) - 1 : -1]
            logp, _ = logprobs_and_entropy(logits, torch.tensor([token_ids]), temperature)
            found.append(logp[0].tolist())
    print(json.dumps(found))


if __name__ == "__main__":
    torch.set_num_threads(1)
    command, *args = sys.argv[1:]
    if command == "publish":
        publish(args[0], args[1], int(args[2]), int(args[3]), int(args[4]))
    else:
        logprobs(args[0], float(args[1]))
