"""The GPU tier: real vLLM engines on one CUDA GPU, through the real spool.

Run it with `python -m pytest tests/gpu` (`make test-gpu`). `pytest tests` never collects it
(pytest.ini's norecursedirs). Where no CUDA GPU is visible the run fails at collection with a
message saying so, rather than skipping: a GPU tier that skipped would pass on any machine.

Engines start in tens of seconds, so each module shares its engines between its tests (module
fixtures, torn down before the next module starts: each module begins with the GPU to itself).
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

NO_GPU = (
    "tests/gpu needs a CUDA GPU and none is visible to torch here (torch.cuda.is_available() is False"
    "{detail}). Run the GPU tier on a GPU host (check nvidia-smi and CUDA_VISIBLE_DEVICES); the CPU "
    "suite is `pytest tests`."
)


def _gpu_problem() -> str | None:
    """None when a CUDA GPU is usable, else what is missing."""
    try:
        import torch
    except ImportError:
        return NO_GPU.format(detail="; torch does not import")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return NO_GPU.format(detail=f"; torch {torch.__version__} is {build}")
    return None


def pytest_collection_modifyitems(config, items):
    ours = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    for item in ours:
        item.add_marker(pytest.mark.gpu)
    if ours:
        problem = _gpu_problem()
        if problem:
            raise pytest.UsageError(problem)


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """The tiny models (gpu_support.build_models), built once for the whole tier."""
    import torch
    from gpu_support import build_models

    torch.set_num_threads(4)
    return build_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def reference():
    from gpu_support import ScaledReference

    return ScaledReference()


@pytest.fixture
def client_for():
    """SpoolClient(spool_dir) factory; the clients close at the end of the test."""
    from protocol.client import SpoolClient

    clients = []

    def make(spool_dir: Path) -> SpoolClient:
        client = SpoolClient(spool_dir, no_worker_grace_s=30)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture(scope="session", autouse=True)
def device_report():
    """Print the device once, so a run's log says what it ran on."""
    import torch

    name = torch.cuda.get_device_name(0)
    free, total = torch.cuda.mem_get_info()
    print(f"\nGPU tier on {name}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free; torch {torch.__version__}")
    yield
