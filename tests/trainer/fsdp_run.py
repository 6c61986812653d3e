"""Run by the FSDP test under `torchrun --nproc_per_node=2`: one training run whose config comes
as JSON in argv[1], sampled by the deterministic test sampler on rank 0."""

import sys
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)

from local_sampler import TorchSampler  # noqa: E402

from trainer_svc.config import Config  # noqa: E402
from trainer_svc.loop import train  # noqa: E402
from trainer_svc.run import exit_process  # noqa: E402

if __name__ == "__main__":
    cfg = msgspec.json.decode(Path(sys.argv[1]).read_bytes(), type=Config)
    exit_process(train(cfg, make_sampler=lambda cfg, launch_id: TorchSampler(cfg)))
