"""Figures for people: reward curves of runs, read back from MLflow.

    python -m tasks.report --run-id ID [--run-id ID2 ...] --out docs/reward_curve.png
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Sequence

from tasks import tracking


def reward_curves(run_ids: Sequence[str], key: str = "rollout/reward_mean",
                  more_keys: Sequence[str] = ()) -> Dict[str, List[tuple]]:
    """``{label: [(step, value), ...]}``; the label is the run's name (algorithm-date by default), with
    the metric's name after it when several keys are plotted (``key`` and ``more_keys``)."""
    c = tracking.client()
    keys = [key, *more_keys]
    return {(c.get_run(r).info.run_name or r) + (f": {k}" if len(keys) > 1 else ""): tracking.metric_history(r, k)
            for r in run_ids for k in keys}


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
    p.add_argument("--ylabel", default="mean reward")
    p.add_argument("--out", default="docs/reward_curve.png")
    a = p.parse_args(argv)
    keys = a.key or ["rollout/reward_mean"]
    print(plot(reward_curves(a.run_id, keys[0], keys[1:]), a.out, a.title, a.ylabel))


if __name__ == "__main__":
    main()
