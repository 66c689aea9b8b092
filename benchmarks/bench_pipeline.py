"""On- vs off-policy seconds per iteration in the pod-level harness (``tests/cluster``), every node a
fresh pod pinned to one core, two ready nodes at a time (the 2-core machine as two cluster nodes).

    python benchmarks/bench_pipeline.py [--quick] [--json PATH] [--iterations N] [--cases demo,compute-bound]

Each case runs GRPO from the compiled package (``make package``, the harness's deployment: a two-node
actor update) twice with the same seeds, ``run.off_policy_steps=0`` and ``=1`` (``actor.tis_cap=2``):
seconds per iteration are the mean time between consecutive commits (pod starts included, the set-up
and the first iteration's rollout not); the reward is the held-out ``eval/reward_mean`` after the
run's last iteration, the same number of samples on both sides. Cases: the demo (``tiny_grpo``) and a
compute-bound one (``bench_grpo``'s 512×8 model, smaller batch: 16 prompts × 4, 32 tokens). ``--quick``
runs the demo only. Slow (each run is tens of pods): ``make bench`` runs it only without QUICK=1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402

CASES: Dict[str, Tuple[str, List[str]]] = {
    "demo": ("configs/tiny_grpo.yaml", ["rollout.prompts_per_iteration=16"]),
    "compute-bound": ("configs/bench_grpo.yaml", ["rollout.prompts_per_iteration=16", "rollout.max_new_tokens=32",
                                                  "actor.micro_batch_size=4"]),
}
OFF = ["run.off_policy_steps=1", "actor.tis_cap=2"]


def commit_spans(ex) -> List[float]:
    """End times of the commit nodes, in order."""
    return sorted(max(p.started + p.seconds for p in a.pods) for a in ex.of_task(".commit_iteration") if a.pods)


def task_seconds(ex) -> Dict[str, float]:
    """Mean seconds of one node of each task (its pods' longest), pod start included: where an iteration's
    time goes, to explain the ratio (``rollout``, ``score``, ``actor_update``, ...)."""
    spans: Dict[str, List[float]] = {}
    for a in ex.attempts:
        if a.pods:
            spans.setdefault(a.task.rsplit(".", 1)[-1], []).append(max(p.seconds for p in a.pods))
    return {t: sum(v) / len(v) for t, v in sorted(spans.items())}


def run_case(make, mlflow_url: str, root: str, preset: str, overrides: List[str], name: str) -> Tuple[float, float]:
    """``(seconds per iteration, final eval reward)`` of one harness run; prints its mean seconds per task."""
    from mlflow.tracking import MlflowClient

    from tests.cluster.conftest import TOPOLOGY

    ex = make().execute("workflows.reinforce.reinforce_training",
                        {"preset": preset, "overrides": overrides + TOPOLOGY + [f"run.storage_root={root}"],
                         "run_name": name})
    if ex.error:
        raise RuntimeError(f"{name}: {ex.error}")
    ends = commit_spans(ex)
    print(f"{root}: mean s per node: " + ", ".join(f"{t} {v:.0f}" for t, v in task_seconds(ex).items()), flush=True)
    client = MlflowClient(mlflow_url)
    run = client.search_runs([client.get_experiment_by_name("flyte-rlhf").experiment_id],
                             f"tags.storage LIKE '{root}/%'")[0]
    evals = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/reward_mean"))
    return (ends[-1] - ends[0]) / (len(ends) - 1), evals[-1][1]


def measure(cases: List[str], iterations: int) -> List[Row]:
    from tests.cluster.conftest import DEPLOY, IMAGE, new_cluster, registration_env
    from tests.cluster.package import build_package, load_package
    from tests.conftest import BUCKET
    from tests.processes import mlflow_server, moto_s3_server

    common = [f"run.num_iterations={iterations}", f"run.eval_interval={iterations}", "run.save_interval=100",
              "run.iterations_per_chunk=100", "actor.minibatch_size=16", "data.num_demo_eval_prompts=16"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, moto_s3_server(BUCKET) as s3, mlflow_server(Path(tmp) / "mlflow") as ml:
        package = load_package(build_package(Path(tmp) / "package", IMAGE, *DEPLOY, registration_env(s3, ml)))
        make = lambda: new_cluster(package, s3, Path(tmp) / "pods", Path(tmp) / "baked",  # noqa: E731
                                   parallelism=2, pin_cores=(0, 1))
        for case in cases:
            preset, extra = CASES[case]
            on = run_case(make, ml, f"s3://{BUCKET}/{case}-on", preset, common + extra, "on")
            off = run_case(make, ml, f"s3://{BUCKET}/{case}-off", preset, common + extra + OFF, "off")
            rows += case_rows(case, on, off, iterations)
    return rows


def case_rows(case: str, on: Tuple[float, float], off: Tuple[float, float], iterations: int) -> List[Row]:
    """The two rows of one case from ``(seconds per iteration, eval reward)`` of each run: the time ratio
    off / on (below 1: the pipeline is faster) and the reward difference off − on after the same samples."""
    return [row("pipeline", f"{case}: off- vs on-policy s/iteration (harness, 1 core per pod)", off[0] / on[0], "x",
                f"{off[0]:.0f} vs {on[0]:.0f} s per iteration, {iterations} iterations"),
            row("pipeline", f"{case}: eval reward after {iterations} iterations, off − on", off[1] - on[1], "",
                f"on-policy {on[1]:.3f}, off-policy {off[1]:.3f} (same samples)")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(parser)  # --quick: the demo case only
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = parser.parse_args()
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; known: {sorted(CASES)}")
    out = measure(["demo"] if args.quick else cases, args.iterations)
    print_rows(out)
    write_rows(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
