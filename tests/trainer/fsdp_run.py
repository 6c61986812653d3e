"""Run by the FSDP tests under torchrun: one training run whose config comes as JSON in argv[1],
sampled by the deterministic test sampler on rank 0, or, with `--through-spool`, by the rollout
service through the spool the config names (served by spool_server.SpoolServer)."""

import sys
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)

from local_sampler import TorchSampler  # noqa: E402

from trainer_svc.config import Config  # noqa: E402
from trainer_svc.run.loop import train  # noqa: E402
from trainer_svc.run.setup import exit_process  # noqa: E402

if __name__ == "__main__":
    cfg = msgspec.json.decode(Path(sys.argv[1]).read_bytes(), type=Config)
    through_spool = "--through-spool" in sys.argv[2:]
    exit_process(train(cfg, make_sampler=None if through_spool else lambda cfg, launch_id: TorchSampler(cfg)))
