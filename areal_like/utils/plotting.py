"""Curves of a run (reward, accuracy, staleness, throughput) from its metrics JSONL, as a PNG."""

from __future__ import annotations

from pathlib import Path

from areal_like.utils.metrics_logger import read_metrics

PANELS = [
    ("reward", ["actor/task_reward/avg"]),
    ("held-out accuracy", ["eval/accuracy", "eval/pass@4", "eval/pass@8"]),
    ("staleness (versions)", ["rollout/staleness_avg", "rollout/staleness_max"]),
    ("throughput (tokens/s)", ["perf/train_tokens_per_s"]),
]


def plot_run(metrics_jsonl: str | Path, out_png: str | Path, title: str = "") -> Path:
    """Plot whichever of the known keys the run logged; one panel per quantity."""
    import matplotlib  # here, at the end of a run: every process of a run imports this module

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_jsonl)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (label, keys) in zip(axes.flat, PANELS, strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, ms=3, label=key)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title or str(metrics_jsonl))
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
