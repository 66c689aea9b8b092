"""Figures for people: reward curves of runs, read back from MLflow.

    python -m models.tracking.report --run-id ID [--run-id ID2 ...] --out docs/reward_curve.png
    python -m models.tracking.report --run-id ID --key eval/math_reward_mean --key reward/math_reward_mean --out ...

Several runs: one curve per run, labelled by run name; several keys: one curve per key.
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Sequence

from models import tracking


def reward_curves(run_ids: Sequence[str], key: str = "rollout/reward_mean") -> Dict[str, List[tuple]]:
    """``{label: [(step, value), ...]}``; the label is the run's name (algorithm-date by default)."""
    c = tracking.client()
    return {c.get_run(r).info.run_name or r: tracking.metric_history(r, key) for r in run_ids}


def metric_curves(run_ids: Sequence[str], keys: Sequence[str]) -> Dict[str, List[tuple]]:
    """One curve per (run, key): labelled by run name with one key, by key with one run, else both."""
    out: Dict[str, List[tuple]] = {}
    for key in keys:
        for label, pts in reward_curves(run_ids, key).items():
            out[label if len(keys) == 1 else key if len(run_ids) == 1 else f"{label}: {key}"] = pts
    return out


def plot(curves: Dict[str, List[tuple]], out: str, title: str, ylabel: str = "mean reward") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for label, pts in curves.items():
        if pts:
            ax.plot([s + 1 for s, _ in pts], [v for _, v in pts], marker="o", markersize=3, label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: List[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Plot reward curves of MLflow runs")
    p.add_argument("--run-id", action="append", required=True, help="MLflow run id (repeat for several)")
    p.add_argument("--key", action="append", help="metric to plot (repeat for several; default rollout/reward_mean)")
    p.add_argument("--title", default="Tiny reversal task: mean rollout reward")
    p.add_argument("--ylabel", default="", help="y axis label (default: the metric, or 'mean reward' for several)")
    p.add_argument("--out", default="docs/reward_curve.png")
    a = p.parse_args(argv)
    ylabel = a.ylabel or ("mean reward" if not a.key or len(a.key) > 1 else a.key[0])
    print(plot(metric_curves(a.run_id, a.key or ["rollout/reward_mean"]), a.out, a.title, ylabel))


if __name__ == "__main__":
    main()
