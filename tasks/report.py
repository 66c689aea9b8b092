"""Figures for people: reward curves of runs, read back from MLflow.

    python -m tasks.report --run-id ID [--run-id ID2 ...] --out docs/reward_curve.png
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Sequence

from tasks import tracking


def reward_curves(run_ids: Sequence[str], key: str = "rollout/reward_mean") -> Dict[str, List[tuple]]:
    """``{label: [(step, value), ...]}``; the label is the run's name (algorithm-date by default)."""
    c = tracking.client()
    return {c.get_run(r).info.run_name or r: tracking.metric_history(r, key) for r in run_ids}


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
    p.add_argument("--key", default="rollout/reward_mean")
    p.add_argument("--title", default="Tiny reversal task: mean rollout reward")
    p.add_argument("--out", default="docs/reward_curve.png")
    a = p.parse_args(argv)
    print(plot(reward_curves(a.run_id, a.key), a.out, a.title))


if __name__ == "__main__":
    main()
