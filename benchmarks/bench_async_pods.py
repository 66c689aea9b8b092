"""Asynchronous training in the pod-level harness (``tests/cluster``): the compiled package, every node a fresh pod
pinned to one of two cores, so the engine service and the actor trainer service each run on a core of their own.

    python benchmarks/bench_async_pods.py [--quick] [--iterations N] [--staleness 0,2] [--overrides JSON] [--json PATH]

One resident tiny GRPO run per k of ``run.max_staleness`` (``actor.tis_cap=2`` from k = 1), the same seeds, the HF
engine, the harness's actor topology (2 pods × 2 ranks), up to three ready nodes at a time (the two services and an
iteration's node). Per k: seconds per iteration (the mean time between consecutive commits, pod starts included),
the held-out ``eval/reward_mean`` after the last iteration (16 prompts), and with k ≥ 2 the means of
``async/engine_idle_fraction`` and ``async/trainer_idle_fraction`` after the first iteration. ``--quick``: 3
iterations (default 5). ``--overrides``: a JSON list of config overrides for every run (a larger batch, so that
generation is the slower side: ``'["rollout.prompts_per_iteration=64"]'``). ``--slow-engine S``: the engine sleeps S
seconds per prompt after each generation, in every run (``RLHF_FAULT_SLOW_ENGINE`` in every pod's environment,
models/faults.py): generation the slower side, on its own core, as an engine on a GPU of its own would be.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_pipeline import run_case  # noqa: E402
from benchmarks.rows import Row, add_bench_args, print_rows, row, write_rows  # noqa: E402


def idle(mlflow_url: str, root: str) -> Dict[str, float]:
    """The mean async idle fractions of the run stored under ``root`` (none below k = 2)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_url)
    run = client.search_runs([client.get_experiment_by_name("flyte-rlhf").experiment_id],
                             f"tags.storage LIKE '{root}/%'")[0]
    out = {}
    for side in ("engine", "trainer"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id,
                                                                              f"async/{side}_idle_fraction"))
        if len(history) > 1:
            out[side] = statistics.mean(v for _, v in history[1:])
    return out


def measure(ks: List[int], iterations: int, overrides: List[str] = (), slow_engine: float = 0.0) -> List[Row]:
    from tests.cluster.conftest import DEPLOY, IMAGE, new_cluster, registration_env
    from tests.cluster.package import build_package, load_package
    from tests.conftest import BUCKET
    from tests.processes import mlflow_server, moto_s3_server

    common = [f"run.num_iterations={iterations}", f"run.eval_interval={iterations}", "run.save_interval=100",
              "run.iterations_per_chunk=100", "actor.minibatch_size=16", "data.num_demo_eval_prompts=16",
              "rollout.engine=hf", "run.resident=true", "run.resident_idle_timeout_s=600", *overrides]
    out, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp, moto_s3_server(BUCKET) as s3, mlflow_server(Path(tmp) / "mlflow") as ml:
        package = load_package(build_package(Path(tmp) / "package", IMAGE, *DEPLOY, registration_env(s3, ml)))
        slow = {}
        if slow_engine:  # every pod's environment, as a node's (the engine service's pod reads it)
            from models.faults import SLOW_ENGINE_ENV

            slow = {SLOW_ENGINE_ENV: str(slow_engine)}
        make = lambda: new_cluster(package, s3, Path(tmp) / "pods", Path(tmp) / "baked",  # noqa: E731
                                   cluster_env=slow, parallelism=3, pin_cores=(0, 1))
        for k in ks:
            lag = [f"run.max_staleness={k}", "actor.tis_cap=2"] if k else []
            root = f"s3://{BUCKET}/k{k}"
            out[k] = run_case(make, ml, root, "configs/tiny_grpo.yaml", common + lag, f"k{k}")
            sides = idle(ml, root)
            print(f"k={k}: {out[k][0]:.1f} s/iteration, eval reward {out[k][1]:.3f}, idle {sides}", flush=True)
            rows.append(row("async_pods", f"k={k}: s per iteration (harness, 1 core per pod)", out[k][0], "s",
                            f"eval reward {out[k][1]:.3f} after {iterations} iterations; idle " +
                            ", ".join(f"{s} {v:.2f}" for s, v in sides.items())))
    for k in (k for k in ks if k and 0 in out):
        rows.append(row("async_pods", f"k={k} / k=0 s per iteration (harness)", out[k][0] / out[0][0], "x",
                        f"{out[k][0]:.1f} vs {out[0][0]:.1f} s", at_most=0.7 if k >= 2 else None))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    parser.add_argument("--iterations", type=int, default=0, help="iterations per run (default 5; --quick 3)")
    parser.add_argument("--staleness", default="0,2", help="comma-separated values of run.max_staleness")
    parser.add_argument("--overrides", default="[]", help="JSON list of config overrides for every run")
    parser.add_argument("--slow-engine", type=float, default=0.0,
                        help="seconds per prompt every engine call sleeps, in every run (generation the slower side)")
    args = parser.parse_args(argv)
    rows = measure([int(k) for k in args.staleness.split(",")], args.iterations or (3 if args.quick else 5),
                   json.loads(args.overrides), args.slow_engine)
    print_rows(rows)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
