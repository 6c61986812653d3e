"""The trainer's side of the spool (rank 0 only): request samples, get token ids and logprobs.

By default the trainer spawns one rollout worker from the rollout venv in its own process
session, preloaded with the starting weights, and tears it down on every exit path (the
trainer's `finally` and `atexit`; SIGKILL of the trainer leaves it to its idle exit). With
`rollout.spawn = false` it uses the workers already serving the spool (systemd).

A dead spawned worker, or no live worker at all, is an error within seconds, never a hang.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from protocol.client import NoLiveWorker, ResultTimeout, SpoolClient
from protocol.messages import Request, Result

from .config import Config
from .gates import rollout_gpu

log = logging.getLogger(__name__)

WORKER_IDLE_EXIT_S = 7200  # an orphaned worker (trainer SIGKILLed) frees its device after this


class RolloutUnavailable(RuntimeError):
    """No worker can serve the trainer's requests; the message says why and what to do."""


class RolloutFailed(RuntimeError):
    """A worker answered with an error result."""


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]  # sampling logprob of each token, as the engine drew it
    text: str
    finish_reason: str


@dataclass
class Group:
    """G samples of one prompt."""

    prompt_ids: list[int]
    samples: list[Sample]


class RolloutService:
    def __init__(self, cfg: Config, *, launch_id: str, world_size: int = 1, cuda_devices: int | None = None):
        """`world_size`, `cuda_devices`: the training ranks and the GPUs this process sees; the
        spawned worker gets the GPU the topology gate approved (gates.rollout_gpu)."""
        self.cfg = cfg
        self.world_size = world_size
        if cuda_devices is None:
            import torch

            cuda_devices = torch.cuda.device_count()
        self.cuda_devices = cuda_devices
        self.launch_id = launch_id
        self.proc: subprocess.Popen | None = None
        self.log_path = cfg.run_dir / "rollout-worker.log"
        if cfg.rollout.spawn:
            self.proc = self._spawn()
            atexit.register(self.close)
        self.client = SpoolClient(cfg.spool_dir, no_worker_grace_s=cfg.rollout.no_worker_grace_s)

    def _spawn(self) -> subprocess.Popen:
        cfg = self.cfg
        executable = Path(cfg.rollout.rollout_venv) / "bin" / "rollout-svc"
        if not executable.exists():
            raise RolloutUnavailable(
                f"{executable} does not exist: create the rollout venv with `make venvs`, or set rollout.rollout_venv"
            )
        command = [
            str(executable),
            "serve",
            "--engine",
            "vllm",
            "--spool",
            str(cfg.spool_dir),
            "--worker-id",
            f"{cfg.run_dir.name[:40]}-rollout",
            "--weights",
            cfg.model.path,
            "--allowed-root",
            str(Path(cfg.model.path).parent),
            "--allowed-root",
            str(cfg.publish_dir),
            "--idle-exit",
            str(WORKER_IDLE_EXIT_S),
            *cfg.rollout.worker_args,
        ]
        cfg.publish_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        gpu = rollout_gpu(self.world_size, self.cuda_devices, colocate=cfg.rollout.colocate)
        if gpu is not None and cfg.rollout.colocate:
            # Its share of the GPU, and asleep (weights and KV cache freed) whenever it has no
            # request: while the trainer steps.
            command += ["--gpu-memory-utilization", str(cfg.rollout.colocate_gpu_memory), "--sleep-when-idle", "0.5"]
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        log.info("starting rollout worker: %s (log: %s)", " ".join(command), self.log_path)
        with open(self.log_path, "ab") as out:
            # Its own session: torchrun's or a terminal's signals do not reach it; we stop it.
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def close(self) -> None:
        """Stop the spawned worker (SIGTERM, then SIGKILL of its session). Idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the engine processes share its session
            except ProcessLookupError:
                pass
        self.client.close()

    def _check_worker(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RolloutUnavailable(f"the rollout worker exited with code {self.proc.returncode}; see {self.log_path}")

    def sample(
        self,
        prompts: list[str],
        *,
        weights_dir: str,
        content_id: str | None,
        step: int,
        attempt: int,
        seed: int,
        n: int | None = None,
        temperature: float | None = None,
        tag: str = "train",
    ) -> list[Group]:
        """`n` samples (default G) of each prompt, from the given weights."""
        r = self.cfg.rollout
        request = Request(
            request_id=f"{self.cfg.run_dir.name[:40]}-{self.launch_id}-{tag}-s{step:08d}-a{attempt}",
            weights_dir=weights_dir,
            weights_content_id=content_id,
            prompts=prompts,
            n_samples_per_prompt=n or r.samples_per_prompt,
            max_tokens=r.max_tokens,
            temperature=r.temperature if temperature is None else temperature,
            top_p=r.top_p,
            seed=seed,
            tag=tag,
        )
        self.client.submit(request)
        result = self._wait(request.request_id)
        if not result.ok:
            raise RolloutFailed(
                f"rollout request {request.request_id} failed: {result.error.code.value}: {result.error.message}"
            )
        return to_groups(result)

    def _wait(self, request_id: str) -> Result:
        try:
            return self.client.wait([request_id], timeout_s=self.cfg.rollout.timeout_s, on_poll=self._check_worker)[
                request_id
            ]
        except ResultTimeout:
            raise RolloutUnavailable(
                f"no result for {request_id} after {self.cfg.rollout.timeout_s:.0f} s (rollout.timeout_s); "
                f"`spoolctl stats -s {self.cfg.spool_dir}` shows what the workers do"
            ) from None
        except NoLiveWorker as exc:
            self._check_worker()  # a dead spawned worker is the better explanation
            raise RolloutUnavailable(str(exc)) from None


def to_groups(result: Result) -> list[Group]:
    groups = []
    for prompt_ids, ids, logprobs, texts, reasons in zip(
        result.prompt_token_ids, result.token_ids, result.logprobs, result.texts, result.finish_reasons, strict=True
    ):
        samples = [Sample(list(i), list(lp), t, f) for i, lp, t, f in zip(ids, logprobs, texts, reasons, strict=True)]
        groups.append(Group(list(prompt_ids), samples))
    return groups
