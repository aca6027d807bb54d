"""Curves of a run (reward, accuracy, staleness, throughput, the train/inference gap) from its
metrics JSONL, as a PNG."""

from __future__ import annotations

from pathlib import Path

from areal_like.utils.metrics_logger import read_metrics

# (title, keys, y scale)
PANELS = [
    ("reward", ["actor/task_reward/avg"], "linear"),
    ("held-out accuracy", ["eval/accuracy", "eval/pass@4", "eval/pass@8"], "linear"),
    ("staleness (versions)", ["rollout/staleness_avg", "rollout/staleness_max"], "linear"),
    ("throughput (tokens/s)", ["perf/train_tokens_per_s"], "linear"),
    ("train/inference gap |log p_train - log p_infer|",
     ["actor/gap/abs_log_diff/avg", "actor/gap/abs_log_diff/max",
      "actor/gap/lag0/abs_log_diff/avg", "actor/gap/lag1/abs_log_diff/avg",
      "actor/gap/lag2/abs_log_diff/avg"], "log"),
    ("gap: KL(behav || prox) and tokens a correction drops",
     ["actor/gap/k3/avg", "actor/gap/mis_token_masked/avg", "actor/gap/icepop_masked/avg",
      "actor/gap/tis_truncated/avg"], "log"),
]


def plot_run(metrics_jsonl: str | Path, out_png: str | Path, title: str = "") -> Path:
    """Plot whichever of the known keys the run logged; one panel per quantity."""
    import matplotlib  # here, at the end of a run: every process of a run imports this module

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_jsonl)
    fig, axes = plt.subplots(3, 2, figsize=(11, 10))
    for ax, (label, keys, scale) in zip(axes.flat, PANELS, strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, ms=3, label=key)
        if scale == "log" and ax.lines:  # zeros (nothing dropped) stay on the plot
            ax.set_yscale("symlog", linthresh=1e-9)
        ax.set_title(label, fontsize=9)
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
