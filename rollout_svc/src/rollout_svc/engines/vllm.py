"""The vLLM engine: one offline `LLM`, its weights reloaded in place when a request names others.

Weight changes, cheapest path first:
- same directory and content id as loaded: nothing to do;
- same architecture and tokenizer: `reload_weights` in place (no new engine), reset the prefix
  cache, then check that the engine's tensors equal the files' (stale weights after a reload
  are a known failure mode of in-place reloads);
- architecture or tokenizer changed, or the in-place reload failed or left stale tensors:
  build a new engine.

Each load reports its seconds and the bytes of the weight files it loaded (0 and 0 when the
weights were already live), and the engine's state ("loading", "reloading", "generating") goes
to the listener set with `set_state_listener`.

Sampling logprobs are vLLM's `processed_logprobs`: the log-probabilities of the distribution the
token was drawn from (temperature and top-p applied), which is what an importance ratio needs.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import time
from typing import NamedTuple

from protocol.messages import ErrorCode, Request

from ..errors import RequestFailed
from ..weights import Weights, WeightsPolicy, check_tokenizer_fits
from .base import Completion, StateListener, ignore_state

log = logging.getLogger(__name__)

EXTENSION = "rollout_svc.engines.vllm_extension.WeightProbe"
PROBED_TENSORS = 6  # largest comparable tensors checked after each reload
PROBE_RTOL = 1e-5
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


class StaleWeights(RuntimeError):
    """The engine's tensors differ from the files after a reload."""


class Load(NamedTuple):
    """What making weights live cost: seconds, and bytes of weight files loaded."""

    seconds: float
    bytes: int


ALREADY_LIVE = Load(0.0, 0)


class VllmEngine:
    def __init__(
        self,
        *,
        policy: WeightsPolicy,
        device: str = "cpu",
        dtype: str = "auto",
        max_model_len: int | None = None,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.85,
        enforce_eager: bool = True,
        seed: int = 0,
    ):
        import vllm

        self.name = f"vllm {vllm.__version__}"
        self.device = device
        self.policy = policy
        self.dtype = dtype if dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enforce_eager = enforce_eager
        self.seed = seed
        self._on_state: StateListener = ignore_state
        self.llm = None
        self.weights: Weights | None = None
        self.tokenizer_id: str | None = None
        self.build_s = 0.0  # time of the last engine build

    @property
    def weights_dir(self) -> str | None:
        return self.weights.path if self.weights else None

    @property
    def weights_content_id(self) -> str | None:
        return self.weights.content_id if self.weights else None

    def set_state_listener(self, listener: StateListener) -> None:
        self._on_state = listener

    # -- weights ---------------------------------------------------------------------------------

    def ensure_weights(self, weights_dir: str, expected_content_id: str | None = None) -> float:
        """Make `weights_dir` the live weights; returns the seconds it took (0 if already live)."""
        return self.load(weights_dir, expected_content_id).seconds

    def load(self, weights_dir: str, expected_content_id: str | None = None) -> Load:
        """Make `weights_dir` the live weights: in place when it can, else in a new engine."""
        weights = self.policy.inspect(weights_dir)
        if expected_content_id is not None and weights.content_id != expected_content_id:
            raise RequestFailed(
                ErrorCode.WEIGHTS_INVALID,
                f"weights_dir {weights_dir} has content id {weights.content_id}, the request's weights_content_id "
                f"is {expected_content_id}: the directory was replaced since the request was written; "
                "resubmit with the new weights_content_id or without one",
            )
        live = self.weights
        if live is not None and (weights.real_path, weights.content_id) == (live.real_path, live.content_id):
            return ALREADY_LIVE
        tokenizer, tokenizer_id = _load_tokenizer(weights)
        check_tokenizer_fits(weights, len(tokenizer))
        started = time.monotonic()
        same_shape = (
            self.llm is not None
            and live is not None
            and weights.architecture == live.architecture
            and tokenizer_id == self.tokenizer_id
        )
        if same_shape:
            try:
                self._reload_in_place(weights)
            except Exception as exc:  # a failed in-place reload must not leave a broken engine
                log.warning("in-place reload of %s failed (%s); building a new engine", weights_dir, exc)
                self._build(weights)
        else:
            self._build(weights)
        self.weights, self.tokenizer_id = weights, tokenizer_id
        return Load(time.monotonic() - started, weights.size_bytes)

    def _reload_in_place(self, weights: Weights) -> None:
        self._on_state("reloading")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": weights.real_path})
        self.llm.reset_prefix_cache()
        self._verify_live(weights)
        log.info("reloaded %s in place", weights.path)

    def _build(self, weights: Weights) -> None:
        self._on_state("loading")
        self.close()
        from vllm import LLM

        if self.device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(self.kv_cache_gib))))
        started = time.monotonic()
        self.llm = LLM(
            weights.real_path,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            enforce_eager=self.enforce_eager,
            gpu_memory_utilization=self.gpu_memory_utilization,
            load_format="safetensors",  # never unpickle a checkpoint
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION,
        )
        self.build_s = time.monotonic() - started
        self._verify_live(weights)
        log.info("engine built for %s in %.1f s", weights.path, self.build_s)

    def _verify_live(self, weights: Weights) -> None:
        """Compare the sums of the largest comparable tensors in the engine with the files'."""
        from safetensors import safe_open

        engine_shapes = self.llm.collective_rpc("parameter_sizes")[0]
        expected: dict[str, float] = {}
        rows: dict[str, int] = {}
        candidates = []
        for shard in weights.shards:
            with safe_open(os.path.join(weights.real_path, shard), framework="pt") as f:
                for name in f.keys():
                    if name in engine_shapes:
                        shape = f.get_slice(name).get_shape()
                        candidates.append((math.prod(shape), shard, name, shape))
        for _, shard, name, shape in sorted(candidates, reverse=True)[:PROBED_TENSORS]:
            with safe_open(os.path.join(weights.real_path, shard), framework="pt") as f:
                tensor = f.get_tensor(name)
            expected[name] = float(tensor.to(_torch_dtype(self.dtype)).double().sum())
            rows[name] = shape[0]
        if not expected:
            log.warning("no tensor of %s can be compared with the engine's; reload not verified", weights.path)
            return
        actual = self.llm.collective_rpc("parameter_sums", args=(rows,))[0]
        for name, want in expected.items():
            got = actual.get(name)
            if got is None or not math.isclose(got, want, rel_tol=PROBE_RTOL, abs_tol=PROBE_RTOL):
                raise StaleWeights(f"{name}: engine sum {got}, file sum {want}")

    # -- generation ------------------------------------------------------------------------------

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Serve requests that share weights_dir in one engine call."""
        from vllm import SamplingParams

        first = requests[0]
        load = self.load(first.weights_dir, first.weights_content_id)
        tokenizer = self.llm.get_tokenizer()
        max_len = self.llm.llm_engine.model_config.max_model_len
        vocab = self.weights.config.get("vocab_size") or len(tokenizer)
        prompts, params, spans = [], [], []
        for request in requests:
            ids_per_prompt = request.prompt_token_ids or [tokenizer(p)["input_ids"] for p in request.prompts]
            _check_prompts(request, ids_per_prompt, max_len, vocab)
            sampling = SamplingParams(
                n=request.n_samples_per_prompt,
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                stop=request.stop or None,
                seed=request.seed,
                logprobs=0 if request.logprobs else None,
            )
            spans.append((len(prompts), len(ids_per_prompt)))
            prompts += [{"prompt_token_ids": ids} for ids in ids_per_prompt]
            params += [sampling] * len(ids_per_prompt)
        self._on_state("generating")
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [_completion(outputs[start : start + count], load) for start, count in spans]

    def close(self) -> None:
        if self.llm is None:
            return
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # the engine process may already be gone
            log.warning("engine shutdown: %s", exc)
        self.llm = None
        self.weights = None
        gc.collect()


def _torch_dtype(name: str):
    import torch

    return {
        "float32": torch.float32,
        "float": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "half": torch.float16,
    }[name]


def _load_tokenizer(weights: Weights):
    """The tokenizer saved with the weights, and an id of its files (a change needs a new engine)."""
    import hashlib

    from transformers import AutoTokenizer

    digest = hashlib.sha256()
    found = False
    for name in _TOKENIZER_FILES:
        path = os.path.join(weights.real_path, name)
        if os.path.exists(path):
            found = True
            with open(path, "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    if not found:
        raise RequestFailed(
            ErrorCode.WEIGHTS_INVALID,
            f"weights_dir {weights.path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); "
            "save the tokenizer next to the weights",
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(weights.real_path)
    except Exception as exc:
        raise RequestFailed(
            ErrorCode.WEIGHTS_INVALID,
            f"weights_dir {weights.path}: the tokenizer does not load ({exc}); save it again with save_pretrained",
        ) from None
    return tokenizer, digest.hexdigest()


def _check_prompts(request: Request, ids_per_prompt: list[list[int]], max_len: int, vocab: int) -> None:
    for i, ids in enumerate(ids_per_prompt):
        if len(ids) + request.max_tokens > max_len:
            raise RequestFailed(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt {i} has {len(ids)} tokens; with max_tokens {request.max_tokens} that exceeds the "
                f"engine's limit of {max_len} tokens. Shorten the prompt, lower max_tokens, or start the worker "
                "with a larger --max-model-len",
            )
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestFailed(
                ErrorCode.INVALID_REQUEST,
                f"prompt_token_ids[{i}] has token ids outside [0, {vocab}): {bad[:5]}; "
                "tokenize with the tokenizer saved in weights_dir",
            )


def _completion(outputs, load: Load) -> Completion:
    texts, token_ids, logprobs, finish, prompt_ids = [], [], [], [], []
    for output in outputs:
        samples = sorted(output.outputs, key=lambda c: c.index)
        texts.append([c.text for c in samples])
        token_ids.append([list(c.token_ids) for c in samples])
        logprobs.append([_sampled_logprobs(c) for c in samples])
        finish.append([c.finish_reason or "length" for c in samples])
        prompt_ids.append(list(output.prompt_token_ids))
    return Completion(texts, token_ids, logprobs, finish, prompt_ids, reload_s=load.seconds, reload_bytes=load.bytes)


def _sampled_logprobs(sample) -> list[float]:
    if sample.logprobs is None:
        return []
    return [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids, strict=True)]
