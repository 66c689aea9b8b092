"""Where a training iteration's time goes: the demo config run through the real Flyte workflow.

    python benchmarks/bench_iteration.py [--quick] [--iterations N] [--preset configs/tiny_ppo.yaml] [--json PATH]

Runs ``ppo_training`` (or the preset's workflow family) in this process exactly as ``pyflyte run``
does locally — same tasks, same elastic launch, same storage and MLflow code — with the Flyte task
methods wrapped by timers. Each leaf task is timed three ways:

- ``outer``: Flyte's ``local_execute`` (input/output literal conversion, the local cache, decks);
- ``inner``: the task's ``execute`` (for ``actor_update``: the whole elastic launch);
- ``body``: the task's own ``time/*`` metrics (logged to MLflow by ``commit_iteration``).

Iteration wall time is commit to commit, so the first iteration (engine start, the dynamic
chunk's compilation) is reported apart, and the steady state is the median of the others.
Causes of the time that is not model compute (generation, score forwards, reward, advantages,
the actor and critic optimisation loops):

- engine: weights into the generation engine (in-place reload after the first iteration);
- model load/save: checkpoints read by score and the updates, the next checkpoint written;
- batch I/O: RolloutBatch writes (reads are inside the model load/save remainder);
- elastic launch: ``actor_update``'s ``execute`` minus its body (process start, rendezvous,
  process-group set-up and tear-down, the agent's monitor interval);
- Flyte per task: ``outer - inner`` summed over the iteration's tasks;
- Flyte graph: the iteration's wall time minus the tasks' ``outer`` times (promise resolution,
  node bookkeeping between tasks);
- commit: ``commit_iteration`` (state.json, MLflow metrics and sample table, checkpoint pruning).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402

LEAVES = ("rollout", "score", "advantages", "actor_update", "critic_update", "commit_iteration")
COMPUTE = {  # metric → what it is; the model compute of an iteration
    "time/generate_s": "generation",
    "time/score_forward_s": "score forwards",
    "time/reward_s": "reward",
    "time/advantages_s": "advantages",
    "time/actor_train_s": "actor optimisation",
    "time/critic_train_s": "critic optimisation",
}
FIXED_TARGET_S = 10.0


class TaskTimer:
    """Wraps Flyte's task methods; records ``(task, kind, start, end)`` for every call in this process."""

    def __init__(self) -> None:
        self.events: List[Tuple[str, str, float, float]] = []

    def wrap(self, cls, method: str, kind: str) -> None:
        orig = getattr(cls, method)

        @functools.wraps(orig)
        def timed(task, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig(task, *args, **kwargs)
            finally:
                self.events.append((task.name.rsplit(".", 1)[-1], kind, t0, time.perf_counter()))

        setattr(cls, method, timed)

    def install(self) -> None:
        from flytekit.core.base_task import Task
        from flytekit.core.python_function_task import PythonFunctionTask
        from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask

        self.wrap(Task, "local_execute", "outer")
        self.wrap(PythonFunctionTask, "execute", "inner")
        self.wrap(PytorchElasticFunctionTask, "execute", "inner")


def per_iteration(events, metrics: Dict[int, Dict[str, float]]) -> List[Dict[str, float]]:
    """Split the leaf-task events at each ``commit_iteration`` end; one breakdown per iteration."""
    commits = sorted(e for e in events if e[0] == "commit_iteration" and e[1] == "outer")
    out, start = [], None
    for i, commit in enumerate(commits):
        end = commit[3]
        window = [e for e in events if e[0] in LEAVES and (start is None or e[2] >= start) and e[3] <= end]
        t = defaultdict(float)
        for name, kind, t0, t1 in window:
            t[f"{kind}/{name}"] += t1 - t0
        m = metrics.get(i, {})
        first_start = min(e[2] for e in window)
        wall = end - (start if start is not None else first_start)
        compute = {label: m.get(key, 0.0) for key, label in COMPUTE.items()}
        bodies = sum(m.get(k, 0.0) for k in ("time/rollout_s", "time/score_s", "time/advantages_s",
                                             "time/actor_update_s", "time/critic_update_s"))
        engine = m.get("time/engine_load_s", 0.0)
        batch_io = m.get("time/rollout_write_s", 0.0)
        outer = sum(v for k, v in t.items() if k.startswith("outer/"))
        inner = sum(v for k, v in t.items() if k.startswith("inner/"))
        causes = {
            "engine weights": engine,
            "model load/save + reads": bodies - sum(compute.values()) - engine - batch_io,
            "batch writes": batch_io,
            "elastic launch": t["inner/actor_update"] - m.get("time/actor_update_s", 0.0),
            "Flyte per task": outer - inner,
            "Flyte graph": wall - outer,
            "commit (state, MLflow)": t["inner/commit_iteration"],
        }
        out.append({"wall": wall, "compute": sum(compute.values()), **compute, **causes,
                    "before first task": first_start - start if start is not None else 0.0})
        start = end
    return out


def run_workflow(preset: str, iterations: int, root: str) -> Tuple[str, TaskTimer, float]:
    """The preset's training workflow in this process, as ``pyflyte run`` runs it locally."""
    from models.config.io import load_config

    timer = TaskTimer()
    timer.install()
    cfg = load_config(preset, [])
    overrides = [f"run.num_iterations={iterations}", "run.eval_interval=0", f"run.storage_root={root}",
                 f"run.save_interval={iterations}", f"run.iterations_per_chunk={iterations}"]
    if cfg.run.algorithm == "ppo":
        from workflows.ppo import ppo_training as training
    else:
        from workflows.reinforce import reinforce_training as training
    t0 = time.perf_counter()
    summary = training(preset=preset, overrides=overrides, run_name="bench")
    return summary.mlflow_run_id, timer, time.perf_counter() - t0


def logged_metrics(run_id: str) -> Dict[int, Dict[str, float]]:
    from models import tracking

    out: Dict[int, Dict[str, float]] = defaultdict(dict)
    for key in tracking.run_metric_keys(run_id):
        if key.startswith("time/"):
            for step, value in tracking.metric_history(run_id, key):
                out[step][key] = value
    return out


def breakdown_rows(iters: List[Dict[str, float]], total_s: float, preset: str) -> List[Row]:
    steady = iters[1:] or iters
    med = {k: statistics.median(it[k] for it in steady) for k in steady[0]}
    fixed = med["wall"] - med["compute"]
    n = len(steady)
    rows = [
        row("iteration", "fixed cost per iteration (not model compute)", fixed, "s",
            f"median of {n} iterations after the first: wall {med['wall']:.2f} s, model compute "
            f"{med['compute']:.2f} s ({preset})", at_most=FIXED_TARGET_S),
        row("iteration", "share of the iteration that is not model compute", 100 * fixed / med["wall"], "%",
            "steady state"),
        row("iteration", "first iteration wall (engine start, chunk compile)", iters[0]["wall"], "s",
            f"whole run {total_s:.1f} s for {len(iters)} iterations incl. set-up"),
    ]
    for label in COMPUTE.values():
        if med.get(label):
            rows.append(row("iteration", f"  compute: {label}", med[label], "s"))
    for cause in ("engine weights", "model load/save + reads", "batch writes", "elastic launch", "Flyte per task",
                  "Flyte graph", "commit (state, MLflow)"):
        rows.append(row("iteration", f"  fixed: {cause}", med[cause], "s"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    parser.add_argument("--preset", default="configs/tiny_ppo.yaml")
    parser.add_argument("--iterations", type=int, default=0, help="default 5 (3 with --quick)")
    args = parser.parse_args()
    iterations = args.iterations or (3 if args.quick else 5)
    os.chdir(REPO)  # presets and the demo task's files resolve from the project root
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with tempfile.TemporaryDirectory(prefix="bench-iteration-") as tmp:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
        with contextlib.redirect_stdout(sys.stderr):  # the run's progress lines; the table goes to stdout
            run_id, timer, total = run_workflow(args.preset, iterations, os.path.join(tmp, "runs"))
        iters = per_iteration(timer.events, logged_metrics(run_id))
    rows = breakdown_rows(iters, total, args.preset)
    print_rows(rows)
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
