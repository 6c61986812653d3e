"""`trainer-svc plot RUN_DIR`: reward, loss, entropy, response length and the trainer/rollout
logprob mismatch against step, from metrics.jsonl, into one PNG.

The reward panel plots `reward_first`, each step's first sampling (the policy's own estimate),
with the trained batch's reward (`reward_trained`, dead groups replaced) as a thin line beside it."""

from __future__ import annotations

from pathlib import Path

from .outputs import read_metrics

PANELS = (
    ("reward_first", "reward (first sampling; orange: trained batch)"),
    ("accuracy", "accuracy"),
    ("loss", "loss"),
    ("entropy", "entropy (per token)"),
    ("response_length", "response length (tokens)"),
    ("mismatch_mean", "|trainer - rollout| logprob"),
)


def _value(row: dict, key: str) -> float:
    # Runs logged before reward_first existed have reward_mean, which then meant the trained batch's.
    fallback = row.get("reward_mean", float("nan")) if key == "reward_first" else float("nan")
    return row.get(key, fallback)


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(run_dir: Path, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir} has no metrics.jsonl rows to plot")
    steps = [r["step"] for r in rows]
    window = max(1, len(rows) // 50)
    fig, axes = plt.subplots(2, 3, figsize=(14, 7), sharex=True)
    for ax, (key, title) in zip(axes.flat, PANELS, strict=False):
        values = [_value(r, key) for r in rows]
        ax.plot(steps, values, color="0.8", linewidth=0.8)
        ax.plot(steps, smooth(values, window), color="C0", linewidth=1.5)
        if key == "reward_first" and all("reward_trained" in r for r in rows):
            ax.plot(steps, smooth([r["reward_trained"] for r in rows], window), color="C1", linewidth=0.8)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("optimizer step")
    fig.suptitle(f"{Path(run_dir).name}: {len(rows)} steps (grey: per step; blue: mean of {window})")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "training.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
