"""Does an iteration cost the same at iteration 500 as at iteration 10? The tiny GRPO preset through
``pyflyte run`` for many iterations, stateless and resident, as a user runs it.

    python benchmarks/bench_long_run.py [--iterations 500] [--modes stateless,resident] [--quick] [--json PATH]

Per run, from the progress line every commit prints (``(W s wall, T s in tasks)``: ``W`` commit to commit,
``T`` the stages' own time): seconds per iteration against the iteration index in bins of 50, the
least-squares slope of ``W`` over the index (iterations 10 onwards: the first carry the engine's start and
the warm-up), the **ratio of the last 50 iterations' mean ``W`` to that of iterations 10-60** (the figure
of issue #36: at most 1.1), the seconds spent outside the tasks (``W - T``: Flyte's local execution, the
commit's storage and MLflow calls) early and late, and at the end the size of MLflow's database and
artifacts and of the run folder. Evaluation is off (it would add spikes at its interval); checkpoints are
kept as the preset keeps them (every ``run.save_interval``-th).

A ratio over 1.1 with a flat ``W - T`` means the tasks themselves slowed (the machine's load: run it on a
quiet one, the figure compares a run with itself); a ``W - T`` that grows is the orchestration.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402

PROGRESS = re.compile(r"iter (\d+)/\d+ .*\((?:([\d.]+) s wall, )?([\d.]+) s in tasks\)")
COMMON = ["run.eval_interval=0", "run.registered_model_name=", "rollout.prompts_per_iteration=16"]
"""Evaluation off; no registration at the end; a quarter of the preset's prompts, so 500 iterations take
minutes, not an hour (the cost around the tasks, the figure here, does not depend on the batch)."""
FIRST = 10
"""Iterations before this one carry the engine's start and the warm-up, and are left out of the fit."""
WINDOW = 50


def launch(mode: str, iterations: int, root: str) -> Tuple[List[Tuple[int, float, float]], float]:
    """``[(iteration, wall s, in-task s)]`` of one run (from its progress lines) and its launch-to-end seconds."""
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{root}/mlflow.db", PYTHONUNBUFFERED="1")
    pyflyte = os.path.join(os.path.dirname(sys.executable), "pyflyte")
    overrides = [f"run.num_iterations={iterations}", f"run.resident={str(mode == 'resident').lower()}",
                 f"run.storage_root={root}/runs"] + COMMON
    t0 = time.perf_counter()
    proc = subprocess.run([pyflyte, "run", "workflows/reinforce.py", "reinforce_training", "--preset",
                           "configs/tiny_grpo.yaml", "--overrides", json.dumps(overrides), "--run_name", mode],
                          cwd=REPO, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"the {mode} run failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return parse_progress(proc.stdout), took


def parse_progress(stdout: str) -> List[Tuple[int, float, float]]:
    """``[(iteration, wall s, in-task s)]`` of the progress lines that have a wall time (all but the first)."""
    return [(int(m[1]) - 1, float(m[2]), float(m[3])) for m in PROGRESS.finditer(stdout) if m[2]]


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench_mode(mode: str, iterations: int, root: str) -> List[Row]:
    progress, took = launch(mode, iterations, root)
    body = [(i, w, t) for i, w, t in progress if i >= FIRST]
    window = min(WINDOW, max(1, len(body) // 2))
    first, last = body[:window], body[-window:]
    mean = lambda rows, k: statistics.fmean(r[k] for r in rows)  # noqa: E731
    ratio = mean(last, 1) / mean(first, 1)
    fit = slope([r[0] for r in body], [r[1] for r in body])
    outside = slope([r[0] for r in body], [r[1] - r[2] for r in body])
    print(f"{mode}: seconds per iteration by iteration (mean of each {WINDOW}; wall / in tasks / outside):")
    for start in range(0, iterations, WINDOW):
        chunk = [r for r in progress if start <= r[0] < start + WINDOW]
        if chunk:
            print(f"  {start:5d}-{chunk[-1][0]:<5d} {mean(chunk, 1):6.2f} {mean(chunk, 2):6.2f} "
                  f"{mean(chunk, 1) - mean(chunk, 2):6.2f}")
    mlflow_bytes = os.path.getsize(f"{root}/mlflow.db") + folder_bytes(Path(root) / "mlruns") \
        if (Path(root) / "mlruns").exists() else os.path.getsize(f"{root}/mlflow.db")
    run_bytes = folder_bytes(Path(root) / "runs" / mode)
    span = f"iterations {last[0][0]}-{last[-1][0]} vs {first[0][0]}-{first[-1][0]}"
    return [
        row("long_run", f"{mode}: last {window} / first {window} s per iteration", ratio, "x",
            f"{mean(last, 1):.2f} s vs {mean(first, 1):.2f} s ({span}); {len(progress) + 1} iterations in {took:.0f} s",
            at_most=1.1),
        row("long_run", f"{mode}: slope of s per iteration", fit, "s/iteration",
            f"least squares over iterations {FIRST}-{body[-1][0]}"),
        row("long_run", f"{mode}: Flyte and commit overhead per iteration (wall - in tasks)", mean(last, 1) - mean(last, 2),
            "s", f"first {window}: {mean(first, 1) - mean(first, 2):.2f} s; slope {outside:.5f} s/iteration"),
        row("long_run", f"{mode}: MLflow (database + artifacts) after {len(progress)} iterations", mlflow_bytes / 1e6,
            "MB", "all runs of this benchmark's tracking store so far"),
        row("long_run", f"{mode}: run folder after {len(progress)} iterations", run_bytes / 1e6, "MB",
            "checkpoints every run.save_interval, every batch"),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    parser.add_argument("--iterations", type=int, default=0, help="iterations per run (default 500; --quick 80)")
    parser.add_argument("--modes", default="stateless,resident", help="comma-separated: stateless, resident")
    parser.add_argument("--root", default="", help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    iterations = args.iterations or (80 if args.quick else 500)
    rows: List[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-long-run-") as tmp:
        root = args.root or tmp
        for mode in args.modes.split(","):
            rows += bench_mode(mode, iterations, root)
    print_rows(rows)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
