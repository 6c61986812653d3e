"""A rollout worker stand-in for trainer tests that go through the real spool: it serves the
spool with the deterministic test sampler (local_sampler.TorchSampler), each request seeded by its
own `seed`, so a run through the spool samples exactly what the same run samples again.

It keeps a status file fresh (a live worker for the trainer's checks and waits), claims requests,
publishes results and archives the requests, through protocol's Spool as a worker does."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

from local_sampler import TorchSampler

from protocol.messages import Result, WorkerStatus
from protocol.spool import Spool
from trainer_svc.rollout_types import WeightsRef

BEAT_S = 0.5


class SpoolServer(threading.Thread):
    def __init__(self, spool_dir: Path, cfg, worker_id: str = "torch-sampler"):
        super().__init__(name="spool-server", daemon=True)
        self.spool = Spool(spool_dir, create=True)
        self.sampler = TorchSampler(cfg)
        self.worker_id = worker_id
        self.stopping = threading.Event()
        self.served: list[str] = []
        self.error: BaseException | None = None
        self._last_beat = 0.0
        self.beat()

    def beat(self) -> None:
        now = time.time()
        self.spool.write_status(
            WorkerStatus(
                worker_id=self.worker_id,
                pid=os.getpid(),
                host=socket.gethostname(),
                device="cpu",
                engine="torch-sampler",
                state="idle",
                lease_s=30.0,
                started_at=now,
                heartbeat_at=now,
            )  # fmt: skip
        )
        self._last_beat = time.monotonic()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                if time.monotonic() - self._last_beat > BEAT_S:
                    self.beat()
                for entry in self.spool.pending():
                    claim = self.spool.claim(entry, self.worker_id)
                    if claim is not None:
                        self.spool.publish_results([self.serve(self.spool.load(claim))])
                        self.spool.finish(claim)
                        self.served.append(claim.request_id)
                self.stopping.wait(0.05)
        except BaseException as exc:  # reported by stop()
            self.error = exc
        finally:
            self.spool.remove_status(self.worker_id)

    def serve(self, request) -> Result:
        groups = self.sampler.sample(
            request.prompts, weights=WeightsRef(request.weights_dir, request.weights_content_id), step=0,
            attempt=0, seed=request.seed, n=request.n_samples_per_prompt, temperature=request.temperature,
            tag=request.tag,
        )  # fmt: skip
        return Result(
            request_id=request.request_id,
            ok=True,
            texts=[[s.text for s in g.samples] for g in groups],
            token_ids=[[s.token_ids for s in g.samples] for g in groups],
            logprobs=[[s.logprobs for s in g.samples] for g in groups],
            finish_reasons=[[s.finish_reason for s in g.samples] for g in groups],
            prompt_token_ids=[g.prompt_ids for g in groups],
            weights_dir=request.weights_dir,
            weights_content_id=request.weights_content_id or "",
            worker_id=self.worker_id,
            engine="torch-sampler",
            finished_at=time.time(),
        )

    def stop(self) -> None:
        self.stopping.set()
        self.join(30)
        assert not self.is_alive(), "the spool server did not stop"
        assert self.error is None, f"the spool server failed: {self.error!r}"
