"""Resident vs stateless in the pod-level harness (``tests/cluster``): the compiled package, every node a fresh
pod pinned to one of two cores (the 2-core machine as two cluster nodes), up to three ready nodes at a time on
each level of the graph (the resident run's three services).

    python benchmarks/bench_resident_pods.py [--quick] [--iterations N] [--json PATH]

One tiny PPO run per mode with the same seeds (the harness's deployment: a two-node actor, a two-pod critic;
the HF engine), ``run.save_interval`` = the run's length, so its only checkpoint is the last iteration's. Per
mode:

- seconds per iteration: the mean time between consecutive commits (pod starts included; the set-up and the
  first iteration not);
- bytes of weights and optimizer state read and written: every pod appends each file it moves to its own
  log (``RLHF_STORAGE_LOG``, :func:`models.storage.count`), classified by name as
  ``benchmarks/iteration_bytes.py`` does. Split into what moved *between checkpoints* (per iteration: any
  file of an iteration that is not a checkpoint's, and every per-iteration read) and the rest (the services'
  start from the reference and the last iteration's checkpoint);
- pod starts per iteration (the iteration's nodes, each worker of a PyTorchJob a pod) and per run.

The resident run's services are nodes of the execution (``tasks/services.py``): they start once, so their
pods count once per run. ``--quick``: 3 iterations.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_pipeline import commit_spans, task_seconds  # noqa: E402
from benchmarks.iteration_bytes import kind  # noqa: E402
from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402

LOG = "storage-transfers.jsonl"
"""Each pod's transfer log, in its working folder (``RLHF_STORAGE_LOG`` relative to it)."""
STATE = ("weights", "optimizer")
PER_RUN_TASKS = ("prepare_run", "run_services", "engine_service", "actor_service", "critic_service",
                 "ppo_iterations", "ppo_chunk", "finish_run", "evaluate", "evaluate_resident")
"""Nodes that run once per run (or per execution or chunk), not per iteration."""


def transfers(ex) -> List[dict]:
    """Every file the execution's pods moved: ``{"op", "url", "nbytes", "task"}``."""
    out = []
    for a in ex.attempts:
        for pod in a.pods:
            path = pod.folder / LOG
            if path.exists():
                out += [{**json.loads(line), "task": a.task.rsplit(".", 1)[-1]} for line in path.read_text().splitlines()]
    return out


def between_checkpoints(t: dict, checkpoint_iteration: int) -> bool:
    """Whether a moved file of weights or optimizer state moved between checkpoints (:func:`state_bytes`): not a
    file of the checkpoint's iteration (written by the update or a service, read back by its commit to log it),
    and moved by an iteration's task, or written by a service under another iteration."""
    if kind(t["url"]) not in STATE or f"/iter-{checkpoint_iteration:06d}/" in t["url"]:
        return False
    return t["task"] not in PER_RUN_TASKS or t["op"] == "write" and "/iter-" in t["url"]


def state_bytes(moved: List[dict], checkpoint_iteration: int) -> Tuple[int, int]:
    """``(between checkpoints, the rest)``: bytes of weights and optimizer state (:func:`between_checkpoints`);
    the rest is the services' load at start, the checkpoint and its commit's read of it."""
    between = sum(t["nbytes"] for t in moved if between_checkpoints(t, checkpoint_iteration))
    rest = sum(t["nbytes"] for t in moved if kind(t["url"]) in STATE) - between
    return between, rest


def pod_starts(ex) -> Tuple[int, int]:
    """``(pods of the iterations' nodes, pods started once per run)``."""
    counts = Counter(a.task.rsplit(".", 1)[-1] in PER_RUN_TASKS for a in ex.attempts for _ in a.pods)
    return counts[False], counts[True]


def run_mode(make, root: str, iterations: int, resident: bool) -> Dict[str, float]:
    from tests.cluster.conftest import CRITIC_TOPOLOGY, TOPOLOGY

    overrides = [f"run.num_iterations={iterations}", f"run.save_interval={iterations}", "run.eval_interval=0",
                 f"run.iterations_per_chunk={iterations}", "rollout.engine=hf", "rollout.prompts_per_iteration=8",
                 "actor.minibatch_size=16", "critic.minibatch_size=16", "critic.micro_batch_size=8",
                 f"run.resident={str(resident).lower()}", "run.resident_idle_timeout_s=600",
                 f"run.storage_root={root}"] + TOPOLOGY + CRITIC_TOPOLOGY
    ex = make().execute("workflows.ppo.ppo_training", {"preset": "configs/tiny_ppo.yaml", "overrides": overrides,
                                                       "run_name": "bench"})
    if ex.error:
        raise RuntimeError(f"{root}: {ex.error}")
    print(f"{root}: mean s per node: " + ", ".join(f"{t} {v:.0f}" for t, v in task_seconds(ex).items()), flush=True)
    ends = commit_spans(ex)
    moved = transfers(ex)
    for t in moved:  # what a reader needs to see where the state moved between checkpoints
        if between_checkpoints(t, iterations - 1):
            print(f"{root}: between checkpoints: {t['task']} {t['op']} {t['nbytes']} B {t['url']}", flush=True)
    between, rest = state_bytes(moved, iterations - 1)
    per_iteration_pods, per_run_pods = pod_starts(ex)
    return {"s": (ends[-1] - ends[0]) / (len(ends) - 1), "between": between / iterations, "rest": rest,
            "pods": per_iteration_pods / iterations, "run_pods": per_run_pods}


def measure(iterations: int, modes=("stateless", "resident")) -> List[Row]:
    from tests.cluster.conftest import DEPLOY, IMAGE, new_cluster, registration_env
    from tests.cluster.package import build_package, load_package
    from tests.conftest import BUCKET
    from tests.processes import mlflow_server, moto_s3_server

    out = {}
    with tempfile.TemporaryDirectory() as tmp, moto_s3_server(BUCKET) as s3, mlflow_server(Path(tmp) / "mlflow") as ml:
        package = load_package(build_package(Path(tmp) / "package", IMAGE, *DEPLOY, registration_env(s3, ml)))
        # three ready nodes at a time: the resident run's three services run side by side (the iterations' graph
        # has at most two ready nodes either way)
        make = lambda: new_cluster(package, s3, Path(tmp) / "pods", Path(tmp) / "baked", parallelism=3,  # noqa: E731
                                   pin_cores=(0, 1), cluster_env={"RLHF_STORAGE_LOG": LOG})
        for mode in modes:
            out[mode] = run_mode(make, f"s3://{BUCKET}/{mode}", iterations, mode == "resident")
            print(f"{mode}: {out[mode]}", flush=True)
    return rows(out, iterations) if len(out) == 2 else []


def rows(out: Dict[str, Dict[str, float]], iterations: int) -> List[Row]:
    s, r = out["stateless"], out["resident"]
    return [row("resident", "harness PPO: resident / stateless s per iteration", r["s"] / s["s"], "x",
                f"{r['s']:.1f} vs {s['s']:.1f} s per iteration, {iterations} iterations, 1 core per pod",
                at_most=0.5),
            row("resident", "harness PPO: resident weights+optimizer bytes per iteration between checkpoints",
                r["between"], "B", f"stateless {s['between'] / 1e6:.1f} MB per iteration; once per run: resident "
                f"{r['rest'] / 1e6:.1f} MB (services' load, the checkpoint), stateless {s['rest'] / 1e6:.1f} MB",
                at_most=0),
            row("resident", "harness PPO: pod starts per iteration, resident vs stateless", r["pods"], "pods",
                f"stateless {s['pods']:.1f}; per run: resident {r['run_pods']}, stateless {s['run_pods']}")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    parser.add_argument("--iterations", type=int, default=0, help="iterations per run (default 6; --quick 3)")
    parser.add_argument("--modes", default="stateless,resident", help="one mode alone prints its figures, no rows")
    args = parser.parse_args(argv)
    out = measure(args.iterations or (3 if args.quick else 6), tuple(args.modes.split(",")))
    print_rows(out)
    write_rows(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
