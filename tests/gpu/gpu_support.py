"""What the GPU tier shares: the e2e tier's worker helpers, device memory readings, the tiny
models, a transformers reference that also reports the logit scale, metrics textfile reading.

The worker helpers (ServedWorker, keep_running, wait_for_status, poll, stop_worker) and the
model builder are the e2e tier's own, loaded from tests/e2e/conftest.py under another module
name, so that both tiers start, share and restart workers the same way.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

E2E = Path(__file__).resolve().parent.parent / "e2e"
if str(E2E) not in sys.path:
    sys.path.append(str(E2E))  # reference_model: transformers' view of a model directory

from reference_model import Reference  # noqa: E402


def _e2e_helpers():
    spec = importlib.util.spec_from_file_location("e2e_workers", E2E / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_e2e = _e2e_helpers()
BIN = _e2e.BIN
ServedWorker = _e2e.ServedWorker
build_model = _e2e.build_model
keep_running = _e2e.keep_running
poll = _e2e.poll
stop_worker = _e2e.stop_worker
wait_for_status = _e2e.wait_for_status

GIB = 2**30
# The device memory budget of each engine in this tier: small enough that two engines (a worker
# and an engine a test builds) fit on one GPU together, large enough that what an engine holds
# stands far above the noise of the readings (a few hundred MiB).
GPU_MEMORY_UTILIZATION = 0.3
MAX_MODEL_LEN = 256


def free_bytes() -> int:
    """Free memory of the visible GPU, device-wide (every process's allocations count)."""
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def build_models(root: Path) -> dict[str, Path]:
    """Tiny models under one allowed root: a and b share an architecture and a tokenizer, wide
    has another architecture, retok is a with another tokenizer (same tokens, another file)."""
    models = {
        "root": root,
        "a": build_model(root / "a", seed=0),
        "b": build_model(root / "b", seed=1),
        "wide": build_model(root / "wide", seed=2, hidden=192),
    }
    retok = root / "retok"
    shutil.copytree(models["a"], retok)
    config_path = retok / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["model_max_length"] = config["model_max_length"] + 1  # tokenizes the same, is another file
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    models["retok"] = retok
    return models


# bfloat16 keeps 8 significant bits: one rounding is off by at most U = 2^-8 of the value. A
# logit is a dot product z_j = h . w_j of the last hidden state h with a row of the output
# embedding; in a bf16 engine h arrives with the rounding errors of every layer (the residual
# stream, the norms, the matmul outputs are all rounded), and w_j itself is rounded. So the
# error of z_j is bounded by c U |h| |w_j| for a small c, and not by c U |z_j|: cancellation in
# the dot product makes |z_j| far smaller than |h| |w_j| (about sqrt(hidden size) times, for
# random weights). With H = |h| max_j |w_j| per step: a logprob z_t/T - logsumexp(z/T) differs
# by at most 2 c U H / T, and greedy may pick a token whose exact logit is up to 2 c U H below the
# best. c = BF16_ROUNDINGS = 6 counts about 4 relative roundings carried by h in this 2-layer
# model, 1 for the rounded weights and 1 for the rounded output. The tests print the measured
# |diff| / (U H / T), so the constant can be set from the H200's figures (an earlier H200 run of
# this model: max |diff| 0.99, mean 0.04 nats at T = 0.8, with H / T about 48, i.e. 5.3 U H / T).
BF16_U = 2.0**-8
BF16_ROUNDINGS = 6


class ScaledReference(Reference):
    """The e2e reference (float32 transformers on the CPU), with each step's logits and scale H."""

    def steps(self, model_dir: Path, prompt_ids: list[int], generated: list[int]):
        """(float64 logits [len(generated), vocab], H [len(generated)]): row i is the distribution
        token i was drawn from; H = |h| max_j |w_j| (see BF16_U)."""
        import torch

        model, _ = self._load(str(model_dir))
        with torch.no_grad():
            ids = torch.tensor([list(prompt_ids) + list(generated)])
            hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0].double()
            weight = model.get_output_embeddings().weight.double()
        logits = hidden @ weight.T
        scale = hidden.norm(dim=-1) * weight.norm(dim=-1).max()
        window = slice(len(prompt_ids) - 1, len(prompt_ids) - 1 + len(generated))
        return logits[window], scale[window]

    def logprobs_and_scales(
        self, model_dir: Path, prompt_ids: list[int], generated: list[int], temperature: float
    ) -> list[tuple[float, float]]:
        """(log p(token) under softmax(logits / T), H / T) per generated token."""
        import torch

        logits, scale = self.steps(model_dir, prompt_ids, generated)
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        return [(float(logprobs[i, t]), float(scale[i]) / temperature) for i, t in enumerate(generated)]

    def greedy_gaps(self, model_dir: Path, prompt_ids: list[int], generated: list[int]) -> list[tuple[float, float]]:
        """(how far the token's logit lies below the step's best, H) per generated token."""
        logits, scale = self.steps(model_dir, prompt_ids, generated)
        return [(float(logits[i].max() - logits[i, t]), float(scale[i])) for i, t in enumerate(generated)]


def check_bf16_greedy(reference: ScaledReference, model_dir: Path, prompt_ids: list[int], generated: list[int]) -> None:
    """Greedy tokens of a bf16 engine are the reference's argmax up to bf16 rounding (see BF16_U):
    each token's exact logit lies within 2 c U H of the step's best. Tokens of other weights
    would lie far below it."""
    for step, (gap, scale) in enumerate(reference.greedy_gaps(model_dir, prompt_ids, generated)):
        bound = 2 * BF16_ROUNDINGS * BF16_U * scale
        where = f"step {step}: token {generated[step]}"
        assert gap <= bound, f"{where} lies {gap:.3f} below the best logit (bound {bound:.3f})"


def check_bf16_logprobs(reference: ScaledReference, model_dir: Path, completion, temperature: float) -> None:
    """Sampling logprobs of a bf16 engine (a Completion or a Result: prompt_token_ids, token_ids,
    logprobs) against float32 transformers: per token within 2 c U H / T (see BF16_U). The measured
    ratio |diff| / (U H / T) is printed, so that c can be checked against each GPU's figures."""
    rows = []  # (|diff|, H / T)
    for prompt_ids, samples, logprobs in zip(
        completion.prompt_token_ids, completion.token_ids, completion.logprobs, strict=True
    ):
        for sample_ids, sample_logprobs in zip(samples, logprobs, strict=True):
            expected = reference.logprobs_and_scales(model_dir, prompt_ids, sample_ids, temperature)
            rows += [(abs(got - want), scale) for got, (want, scale) in zip(sample_logprobs, expected, strict=True)]
    diffs = [d for d, _ in rows]
    ratios = [d / (BF16_U * s) for d, s in rows]
    print(
        f"\nbf16 logprob |vLLM - float32 transformers| over {len(rows)} tokens: max {max(diffs):.3e}, "
        f"mean {sum(diffs) / len(diffs):.3e}; scale H/T max {max(s for _, s in rows):.1f}; "
        f"|diff| / (U H/T): max {max(ratios):.2f}, mean {sum(ratios) / len(ratios):.2f} (bound {2 * BF16_ROUNDINGS})"
    )
    worst = max(range(len(rows)), key=lambda i: ratios[i])
    assert ratios[worst] <= 2 * BF16_ROUNDINGS, f"token {worst}: |diff| {rows[worst][0]:.3f}, H/T {rows[worst][1]:.1f}"


def metric(path: Path, name: str) -> float | None:
    """A sample's value in a worker's metrics textfile (labels ignored), None when absent."""
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        match = re.match(rf"{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", line)
        if match:
            return float(match.group(1))
    return None


def built_engine_pids(log_path: Path) -> list[int]:
    """The engine processes a worker built, in order, from its log."""
    return [int(pid) for pid in re.findall(r"engine process (\d+) built for", log_path.read_text(errors="replace"))]
