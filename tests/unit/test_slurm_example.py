"""deploy/slurm/grpo.sbatch: valid bash, and run with stand-ins for Slurm and the services, it
starts what the README says: `spoolctl init` of the shared spool, one rollout worker per GPU on
each rollout node with a stable id, and one torchrun agent per trainer node with a c10d
rendezvous on the first node; the options it gives `rollout-svc serve` exist."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "grpo.sbatch"

# Each call is one line written by one append: two workers recording at once never interleave.
RECORDER = """#!/usr/bin/env bash
line="$(basename "$0")"
for a in "$@"; do line+=" $(printf '%q' "$a")"; done
printf '%s CUDA_VISIBLE_DEVICES=%s\\n' "$line" "${CUDA_VISIBLE_DEVICES:-}" >> "$CALLS"
"""
# The trainer's stand-in returns once the workers' stand-ins have recorded themselves: the script
# stops its workers when the trainer ends, which could otherwise come before they started.
TRAINER_STAND_IN = (
    RECORDER
    + """for _ in $(seq 1200); do
    [ "$(grep -c '^rollout-svc serve' "$CALLS")" -ge "$GPUS_PER_NODE" ] && exit 0
    sleep 0.1
done
"""
)
# srun runs its command once, as one node would; its own options end at the first non-option.
SRUN = """#!/usr/bin/env bash
printf 'srun %s\\n' "$*" >> "$CALLS"
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
"$@"
"""


def fake_install(tmp_path: Path) -> tuple[Path, dict]:
    bin_dir, root = tmp_path / "bin", tmp_path / "grpo"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'node0\\nnode1\\nnode2\\nnode3\\n'\n")
    for venv, tools in (("rollout", ("spoolctl", "rollout-svc")), ("trainer", ("torchrun", "trainer-svc"))):
        (root / ".venvs" / venv / "bin").mkdir(parents=True)
        for tool in tools:
            (root / ".venvs" / venv / "bin" / tool).write_text(TRAINER_STAND_IN if tool == "torchrun" else RECORDER)
    for path in [*bin_dir.iterdir(), *root.glob(".venvs/*/bin/*")]:
        path.chmod(0o755)
    env = dict(
        os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", CALLS=str(tmp_path / "calls"), GRPO_ROOT=str(root),
        SHARED="/shared/grpo", SLURM_NNODES="4", SLURM_JOB_NODELIST="node[0-3]", SLURM_JOB_ID="77",
        GPUS_PER_NODE="2",
    )  # fmt: skip
    return tmp_path / "calls", env


def test_the_slurm_example_is_valid_bash():
    done = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    directives = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert all(re.fullmatch(r"#SBATCH --[a-z-]+(=\S+)?", line) for line in directives), directives


def test_the_slurm_example_starts_a_worker_per_gpu_and_a_torchrun_agent_per_trainer_node(tmp_path):
    calls_file, env = fake_install(tmp_path)
    done = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = calls_file.read_text().splitlines()
    assert calls[0].startswith("spoolctl init /shared/grpo/spool")
    sruns = [c for c in calls if c.startswith("srun ")]
    assert any("--nodes=2" in c and "--relative=2" in c for c in sruns)  # rollout nodes
    assert any("--nodes=2" in c and "--relative=0" in c for c in sruns)  # trainer nodes
    workers = [shlex.split(c) for c in calls if c.startswith("rollout-svc serve")]
    assert sorted(w[-1] for w in workers) == ["CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=1"]
    ids = [w[w.index("--worker-id") + 1] for w in workers]
    assert len(set(ids)) == 2 and all(re.fullmatch(r".+-gpu[01]", i) for i in ids)
    [agent] = [shlex.split(c) for c in calls if c.startswith("torchrun ")]
    assert {"--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400"} <= set(agent)
    assert agent[-4:-1] == [f"{env['GRPO_ROOT']}/.venvs/trainer/bin/trainer-svc", "train", "/shared/grpo/config.toml"]
    # The options it gives the worker are the worker's.
    help_text = subprocess.run(
        [str(Path(sys.executable).with_name("rollout-svc")), "serve", "--help"], capture_output=True, text=True
    ).stdout
    used = {a for w in workers for a in w if a.startswith("--")}
    assert used and all(option in help_text for option in used), used
