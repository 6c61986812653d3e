"""The process that holds one vLLM engine for VllmEngine (engines/host.py says why a process).

Started as `python -m rollout_svc.engines.vllm_host COMMANDS ANSWERS`; it answers, in order:
`build` (once), `reload`, `add_adapter`, `generate`, `sleep`, `wake`, `facts`, `probe`, `shutdown`. A new
architecture or tokenizer, or a failed reload, is a new process, never a second `LLM` here.

Guarantees:
- a reload reads the weight files straight onto the engine's device (vllm_extension) and runs
  vLLM's post-load processing where the engine needs it (CPU, quantized layers, after a wake);
- after every weight change (build, in-place reload, wake) the largest comparable tensors of
  the engine equal the files' (float64 sums; StaleWeights otherwise), so stale weights after a
  reload or a wake are caught before anything is generated; a load and its check are one call
  into the engine (its sums taken right after its load, read back in one wait for the device),
  with the files' sums made here meanwhile;
- texts are the sampled ids decoded without special tokens (decoded once at the end: vLLM
  detokenizes step by step only for requests with stop strings);
- sampling logprobs are vLLM's `processed_logprobs`: log-probabilities of the distribution each
  token was drawn from (temperature and top-p applied), which is what an importance ratio needs;
- vLLM's sampler runs where flashinfer is absent: unless VLLM_USE_FLASHINFER_SAMPLER is set,
  it is set to 0 when flashinfer does not import (vLLM would otherwise ask for it and die);
- with LoRA (an EngineSpec with lora_rank) a request may be served with an adapter on the live
  weights: vLLM's LoRARequest, the base never reloaded; vLLM caches adapters by id and evicts the
  least recent past max_cpu_loras;
- sleep level 2 drops the weights: waking reloads them from the directory named (the same or
  new ones) between waking the weights' memory and the KV cache's, as vLLM prescribes;
- on CPU no prompt's prefill is cut over two engine steps (scheduler_options), so a seeded batch
  of any size is served, each request sampling what its seeds give;
- what the engine cannot take from a request (an empty prompt, ids past the vocabulary, a prompt
  too long, sampling settings vLLM refuses) is that request's RequestFailed, before generating.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from protocol.messages import Request
from protocol.weight_slots import encode_slot_manifest

from ..adapters import AdapterRef
from ..weights import Weights
from .base import Completion
from .host import SHUTDOWN, serve
from .vllm_requests import check_prompts, checked_sampling_params, prompt_ids, to_completion
from .weight_check import compare, file_sums, plan

log = logging.getLogger("rollout_svc.engines.vllm_host")

EXTENSION = "rollout_svc.engines.vllm_extension.WeightProbe"


@dataclass(frozen=True)
class EngineSpec:
    """How to build the engine: VllmEngine's settings, resolved for the device."""

    device: str  # "cpu" or "cuda:N"
    dtype: str  # float32, bfloat16, float16
    seed: int
    max_model_len: int | None
    enforce_eager: bool  # False: CUDA graphs
    gpu_memory_utilization: float
    kv_cache_gib: float  # CPU only
    sleep_mode: bool  # build with vLLM's sleep mode (GPU only)
    # LoRA: the largest adapter rank the engine is sized for, one of vLLM's (0: built without LoRA);
    # adapters in one engine call; adapters kept in host memory (vLLM evicts the least recent).
    lora_rank: int = 0
    max_loras: int = 1
    max_cpu_loras: int = 4
    # vLLM's torch.compile of the model (GPU): off, decode steps still run as whole-step CUDA graphs
    compile: bool = True


def configure_environment(device: str, dtype: str, kv_cache_gib: float) -> None:
    """Environment vLLM reads when an engine starts; call before building one."""
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(kv_cache_gib))))
    elif dtype == "float32":
        # vLLM's Triton attention multiplies float32 with Triton's default dot precision, TF32
        # (10-bit mantissa): logprobs then differ from the trainer's by 1e-2 or more (measured on
        # an H200). A float32 engine exists to match the trainer exactly, so its dots run in IEEE
        # float32; matmuls outside Triton already do (vLLM sets torch's precision to "highest").
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    if "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ:
        try:
            import flashinfer  # noqa: F401
        except Exception:  # absent or broken: either way vLLM's sampler must not ask for it
            os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
            log.info("flashinfer does not import; VLLM_USE_FLASHINFER_SAMPLER=0")


class LiveEngine:
    """The `LLM` of this process and the weights it holds."""

    def __init__(self):
        self.llm = None
        self.weights: Weights | None = None
        self.post_process = True  # whether an awake engine's reload needs vLLM's post-load processing
        self.engine_shapes: dict[str, list[int]] | None = None  # its parameters' shapes: fixed for its life

    def build(self, spec: EngineSpec, weights: Weights) -> dict:
        configure_environment(spec.device, spec.dtype, spec.kv_cache_gib)
        from vllm import LLM

        started = time.monotonic()
        # A weight slot has no safetensors file: the engine starts with vLLM's dummy weights and
        # the slot is loaded into it in place, as a reload would.
        self.llm = LLM(
            weights.real_path,
            dtype=spec.dtype,
            seed=spec.seed,
            max_model_len=spec.max_model_len,
            enforce_eager=spec.enforce_eager,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            enable_sleep_mode=spec.sleep_mode,
            load_format="dummy" if weights.slot is not None else "safetensors",  # never unpickle a checkpoint
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION,
            **compile_options(spec),
            **lora_options(spec),
            **scheduler_options(spec),
        )
        self.post_process = needs_post_processing(spec.device, self.llm.llm_engine.model_config.quantization)
        self.engine_shapes = self.llm.collective_rpc("parameter_sizes")[0]
        if weights.slot is not None:
            self._load_checked(weights, self.post_process)  # over the dummy weights, as a reload
        else:
            self._verify(weights)
        facts = self.facts() | {"llm_s": time.monotonic() - started}
        log.info("engine built for %s in %.1f s (%s)", weights.path, facts["llm_s"], describe(facts))
        return facts

    def reload(self, weights: Weights) -> None:
        """Load `weights` in place and check them (_load_checked: one call into the engine for both),
        then drop the prefix cache, whose blocks the old weights computed."""
        started = time.monotonic()
        waited = self._load_checked(weights, self.post_process)
        loaded = time.monotonic()
        self.llm.reset_prefix_cache()
        log.info(
            "reloaded %s in %.3f s (weights and check %.3f s, of it waiting for the files' sums %.3f s; prefix "
            "cache %.3f s)",
            weights.path, time.monotonic() - started, loaded - started, waited, time.monotonic() - loaded,
        )  # fmt: skip

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake(self, weights: Weights, reload: bool) -> None:
        """Wake up; with `reload`, load `weights` into the woken weight memory before the KV
        cache comes back (level 2 discarded the old ones; level 1 kept ones now outdated)."""
        started = time.monotonic()
        if reload:
            self.llm.wake_up(tags=["weights"])
            woken = time.monotonic()
            self._load_checked(weights, post_process=True)  # vLLM's whole reload into memory just re-mapped
            loaded = time.monotonic()
            self.llm.wake_up(tags=["kv_cache"])
        else:
            self.llm.wake_up()
            woken = loaded = time.monotonic()
        awake = time.monotonic()
        self.llm.reset_prefix_cache()
        if not reload:  # the weights' memory came back from the host: checked as it is
            self._verify(weights)
        log.info(
            "awake with %s in %.3f s (weights' memory %.3f s, weights %.3f s, KV cache %.3f s, prefix cache and "
            "check %.3f s)",
            weights.path, time.monotonic() - started, woken - started, loaded - woken, awake - loaded,
            time.monotonic() - awake,
        )  # fmt: skip

    def add_adapter(self, adapter: AdapterRef) -> float:
        """Load a LoRA adapter into the engine's cache (vLLM's own: the least recent evicted past
        max_cpu_loras); returns the seconds it took, 0 when the engine holds it already."""
        if adapter.lora_id in self.llm.llm_engine.list_loras():
            return 0.0
        started = time.monotonic()
        self.llm.llm_engine.add_lora(lora_request(adapter))
        seconds = time.monotonic() - started
        log.info("adapter %s (%s) loaded in %.3f s", adapter.content_id, adapter.path, seconds)
        return seconds

    def generate(self, requests: list[Request], adapter: AdapterRef | None = None) -> list[Completion]:
        """Serve requests that share the live weights in one engine call (with `adapter`: those
        weights and that LoRA adapter)."""
        started = time.monotonic()
        tokenizer = self.llm.get_tokenizer()
        max_len = self.llm.llm_engine.model_config.max_model_len
        vocab = self.weights.config.get("vocab_size") or len(tokenizer)
        prompts, params, spans = [], [], []
        for request in requests:
            ids_per_prompt = prompt_ids(request, tokenizer)
            check_prompts(request, ids_per_prompt, max_len, vocab)
            spans.append((len(prompts), len(ids_per_prompt)))
            prompts += [{"prompt_token_ids": ids} for ids in ids_per_prompt]
            params += [checked_sampling_params(request, i) for i in range(len(ids_per_prompt))]
        called = time.monotonic()
        lora = lora_request(adapter) if adapter is not None else None
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        answered = time.monotonic()
        completions = [
            to_completion(outputs[start : start + count], tokenizer, detokenized=bool(request.stop))
            for request, (start, count) in zip(requests, spans, strict=True)
        ]
        log.info(
            "generated %d sequences in %.3f s (LLM.generate %.3f s)",
            sum(len(o.outputs) for o in outputs), time.monotonic() - started, answered - called,
        )  # fmt: skip
        return completions

    def facts(self) -> dict:
        """What runs here: vLLM's version, the process, eager or CUDA graphs, the length limit."""
        import vllm

        return self.llm.collective_rpc("engine_facts")[0] | {
            "vllm": vllm.__version__,
            "pid": os.getpid(),
            "max_model_len": self.llm.llm_engine.model_config.max_model_len,
        }

    def probe(self, method: str, args: tuple) -> object:
        """A WeightProbe method of the model's worker, for checks from outside."""
        return self.llm.collective_rpc(method, args=tuple(args))[0]

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    def _load_checked(self, weights: Weights, post_process: bool) -> float:
        """Load the weight files into the engine in place (vllm_extension.WeightProbe.load_files or
        load_slot: each read straight onto the device; 270 MB on an H200: 0.08 s, 0.14 s with vLLM's
        post-processing, against 0.18-0.22 s for vLLM's `reload_weights` from the directory), and
        check them as _verify does, at no extra round trip: the engine sums its blocks right after
        its load, in the same call, while this process sums the files' blocks in a thread beside it.
        Returns the seconds spent waiting for the files' sums once the engine had answered."""
        self.weights = None  # until verified
        source, blocks = self._probe_plan(weights)
        with ThreadPoolExecutor(1, thread_name_prefix="file-sums") as pool:
            expected = pool.submit(self._file_sums, source, blocks)
            try:
                actual = self._load(weights, post_process, blocks)
            finally:
                answered = time.monotonic()
                expected = expected.result()
                waited = time.monotonic() - answered
                source.close()
        self._compare(weights, expected, actual or {})
        return waited

    def _load(self, weights: Weights, post_process: bool, blocks: dict) -> dict | None:
        if weights.slot is not None:
            manifest = encode_slot_manifest(weights.slot)
            parts = self.llm.collective_rpc("load_slot", args=(weights.real_path, manifest, post_process, blocks))[0]
            log.info(
                "slot %s (step %d, %d MB) loaded: map %.3f s, copy and checksum %.3f s, load_weights %.3f s%s",
                weights.path, weights.slot.step, weights.size_bytes // 10**6, parts["map_s"],
                parts["copy_and_check_s"], parts["load_s"], ", pinned" if parts["pinned"] else "",
            )  # fmt: skip
            return parts["sums"]
        paths = [os.path.join(weights.real_path, shard) for shard in weights.shards]
        return self.llm.collective_rpc("load_files", args=(paths, post_process, blocks))[0]

    def _verify(self, weights: Weights) -> None:
        """Compare the engine's largest comparable tensors with the files' (weight_check), for
        weights already in the engine."""
        self.weights = None
        source, blocks = self._probe_plan(weights)
        try:
            expected = self._file_sums(source, blocks)
        finally:
            source.close()
        actual = self.llm.collective_rpc("parameter_sums", args=(blocks,))[0] if blocks else {}
        self._compare(weights, expected, actual)

    def _probe_plan(self, weights: Weights):
        if self.engine_shapes is None:
            self.engine_shapes = self.llm.collective_rpc("parameter_sizes")[0]
        return plan(weights, self.engine_shapes)

    def _file_sums(self, source, blocks: dict) -> dict[str, float]:
        return file_sums(source, blocks, self.llm.llm_engine.model_config.dtype)

    def _compare(self, weights: Weights, expected: dict[str, float], actual: dict[str, float]) -> None:
        compare(weights, expected, actual)
        self.weights = weights


def lora_request(adapter: AdapterRef):
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.content_id, adapter.lora_id, adapter.path)


def compile_options(spec: EngineSpec) -> dict:
    """vLLM's compilation settings for `spec`: its defaults (torch.compile, piecewise and whole-step
    CUDA graphs), or with compile off on a GPU no torch.compile and the decode steps captured as
    whole-step CUDA graphs, which need no compiled graph to split (vLLM 0.25-0.32). Compiling costs
    a first launch 20-25 s on one H200 and pays where the model's own kernels, not launching them,
    bound a step: large models. Eager engines and the CPU have nothing to turn off."""
    if spec.compile or spec.enforce_eager or spec.device == "cpu":
        return {}
    return {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}


def scheduler_options(spec: EngineSpec) -> dict:
    """vLLM's scheduler settings for `spec`: on CPU a prompt's prefill is never cut over two steps.

    With chunked prefill (vLLM's default) a step's token budget (max_num_batched_tokens, 4096 on
    CPU) cuts the prefill of whatever does not fit: a seeded batch of 16 prompts x 8 samples x 47
    tokens (6,016) was cut, and the model runner then rewinds the cut request's random generator
    (`gen.set_offset(gen.get_offset() - 4)`, vLLM 0.32's gpu_model_runner), which a CPU generator
    cannot do: "CPU Generator does not use offset", and the engine died. Without chunked prefill a
    request waits for a step whose budget holds its whole prompt (vLLM raises the budget to at least
    max_model_len, so every prompt fits one), its generator draws only for tokens it keeps, and a
    seeded request samples what it would alone: results stay seeded and reproducible. The cost is
    a prefill step's size (a prompt is never interleaved in pieces with decodes), which on a CPU,
    where one long prompt already fills a step, changes little. GPU generators have offsets: there
    vLLM's chunking stays."""
    return {"enable_chunked_prefill": False} if spec.device == "cpu" else {}


def lora_options(spec: EngineSpec) -> dict:
    """vLLM's LoRA settings for an engine built with `spec` (none without LoRA)."""
    if not spec.lora_rank:
        return {}
    return dict(
        enable_lora=True, max_lora_rank=spec.lora_rank, max_loras=spec.max_loras, max_cpu_loras=spec.max_cpu_loras
    )


def needs_post_processing(device: str, quantization: str | None) -> bool:
    """Whether loaded weights need vLLM's post-load processing before they serve: on CPU vLLM
    repacks every linear layer for its GEMM kernels, and quantized layers are converted; an
    unquantized model on a GPU serves the checkpoint's tensors as they are (vLLM 0.25-0.32)."""
    return device == "cpu" or quantization is not None


def describe(facts: dict) -> str:
    """'CUDA graphs FULL_AND_PIECEWISE, 67 captured' or 'eager', for logs."""
    mode = facts.get("cudagraph_mode", "NONE").rpartition(".")[2]
    if facts.get("enforce_eager") or mode == "NONE":
        return "eager"
    described = f"CUDA graphs {mode}, {facts.get('cuda_graphs', 0)} captured"
    # vLLM's CompilationMode.NONE, as its name or its value
    if facts.get("compilation_mode", "").rpartition(".")[2] in ("NONE", "0"):
        described += ", no torch.compile"
    return described


def main(argv: list[str]) -> None:
    logging.basicConfig(
        level=os.environ.get("ROLLOUT_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )
    engine = LiveEngine()
    serve(
        {
            "build": engine.build,
            "reload": engine.reload,
            "generate": engine.generate,
            "add_adapter": engine.add_adapter,
            "sleep": engine.sleep,
            "wake": engine.wake,
            "facts": engine.facts,
            "probe": engine.probe,
            SHUTDOWN: engine.shutdown,
        },
        argv,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
