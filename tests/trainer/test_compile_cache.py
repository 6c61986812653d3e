"""torch.compile's artefacts outlive the launch: a trainer process that compiles keeps inductor's
caches in a user cache directory (or TORCHINDUCTOR_CACHE_DIR when set), not in /tmp, so that a
relaunch loads what an earlier launch compiled. Each case runs in a process of its own: the cache
directory is fixed at a process's first compilation."""

from __future__ import annotations

import os
import subprocess
import sys

# What inductor itself resolves as its cache directory (where its compilations are written),
# after the trainer chose one; compiling for real costs tens of seconds on a CPU.
COMPILES = """
from trainer_svc.learning.model import use_compile_cache
chosen = use_compile_cache()
from torch._inductor.runtime.cache_dir_utils import cache_dir
print(chosen, cache_dir())
"""


def inductor_cache_in_a_process(env: dict) -> list[str]:
    """(the directory the trainer chose, the one inductor uses) in a fresh process with `env`."""
    clean = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME")}
    done = subprocess.run([sys.executable, "-c", COMPILES], env={**clean, **env}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_compilations_go_to_the_user_cache(tmp_path):
    expected = str(tmp_path / "cache" / "trainer-svc" / "torchinductor")
    assert inductor_cache_in_a_process({"XDG_CACHE_HOME": str(tmp_path / "cache")}) == [expected, expected]


def test_a_cache_directory_the_user_set_is_kept(tmp_path):
    mine = str(tmp_path / "mine")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "TORCHINDUCTOR_CACHE_DIR": mine}
    assert inductor_cache_in_a_process(env) == [mine, mine]
