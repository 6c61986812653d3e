"""A training step that runs out of device memory stops the run with exit 71 and a message that
names the step, its phase and who held the memory, instead of a traceback. Nothing of the step is
kept: the relaunch resumes from the newest checkpoint and takes the same steps (the run is
deterministic where it is seeded; the step the error cut is taken again whole)."""

from __future__ import annotations

import torch

from protocol import exit_codes

GIB = 2**30


class OutOfDeviceMemory(RuntimeError):
    """The device ran out of memory in a step; the message says what to change."""

    exit_code = exit_codes.OUT_OF_MEMORY

    def __init__(self, step: int, phase: str, device: torch.device, resume_from: str | None, cause: str):
        where = f"step {step}'s {phase}"
        held = holders(device)
        resume = f"the relaunch resumes from checkpoint {resume_from}" if resume_from else "the relaunch starts again"
        super().__init__(
            f"out of memory on {device} in {where} ({cause.splitlines()[0] if cause else 'no detail'}){held}. "
            "Lower train.max_tokens_per_micro_batch (or set it: the padded tokens of one micro-batch), raise "
            "train.grad_accum, or set model.activation_checkpointing = true; if another process took the memory, "
            f"stop it. Then relaunch: {resume}, and takes the same steps"
        )
        self.step, self.phase = step, phase


def holders(device: torch.device) -> str:
    """'; this process held X GiB, other processes Y GiB of Z GiB' on a CUDA device, else ''."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    try:
        free, total = torch.cuda.mem_get_info(device)
        ours = torch.cuda.memory_reserved(device)
    except RuntimeError:  # the runtime itself may be out of memory
        return ""
    others = max(total - free - ours, 0)
    return (
        f"; this process held {ours / GIB:.1f} GiB (tensors {torch.cuda.memory_allocated(device) / GIB:.1f} GiB), "
        f"other processes {others / GIB:.1f} GiB, of the device's {total / GIB:.1f} GiB"
    )
