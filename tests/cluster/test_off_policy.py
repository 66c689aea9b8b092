"""One-step off-policy pipelining through the pod-level harness (``run.off_policy_steps=1``,
docs/off_policy.md): three GRPO iterations from the compiled package, two nodes at a time
(``parallelism=2``, each pod pinned to one core), as propeller runs ready nodes. The rollout of
iteration 2 runs in its own pod while iteration 1's score (and, when it lasts, update) runs in
others: their start and end times overlap, which an on-policy graph never allows (every rollout
waits for the commit before it)."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import DEPLOY, TOPOLOGY, registration_env
from tests.conftest import BUCKET

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = ["run.num_iterations=3", "run.eval_interval=0", "run.save_interval=1", "rollout.prompts_per_iteration=8",
       "actor.minibatch_size=16", "data.num_demo_eval_prompts=8", "run.off_policy_steps=1", "actor.tis_cap=2"]


def spans(ex, task: str):
    """``[(start, end)]`` in monotonic seconds of the node attempts of ``task``, by start (all pods of each)."""
    out = [(min(p.started for p in a.pods), max(p.started + p.seconds for p in a.pods))
           for a in ex.of_task(task) if a.pods]
    return sorted(out)


def overlap(a, b) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def test_rollout_of_the_next_iteration_overlaps_the_update_chain(packages, make_cluster, s3_server, mlflow_url,
                                                                 tmp_path):
    from mlflow.tracking import MlflowClient

    package = packages(*DEPLOY, registration_env(s3_server, mlflow_url))
    cluster = make_cluster(package, parallelism=2, pin_cores=(0, 1))
    root = f"s3://{BUCKET}/offpolicy-{tmp_path.name}"
    ex = cluster.execute("workflows.reinforce.reinforce_training",
                         {"preset": "configs/tiny_grpo.yaml", "overrides": RUN + TOPOLOGY + [f"run.storage_root={root}"],
                          "run_name": "pipelined"})
    report = "\n".join(f"{a.node:18s} {a.task:36s} try {a.attempt} {a.outcome:8s} {a.seconds:6.1f} s {a.error[:200]}"
                       for a in ex.attempts)
    print(report)
    assert not ex.error, f"{ex.error}\n{report}"

    rollouts, scores = spans(ex, ".rollout"), spans(ex, ".score")
    updates, commits = spans(ex, ".actor_update"), spans(ex, ".commit_iteration")
    assert len(rollouts) == len(scores) == len(updates) == len(commits) == 3
    # rollout 2 (from actor 0) starts after commit 0 and runs beside iteration 1's chain (score 1 first)
    assert rollouts[2][0] >= commits[0][1]
    beside = overlap(rollouts[2], scores[1]) + overlap(rollouts[2], updates[1])
    assert beside > 0, f"rollout 2 {rollouts[2]} never ran beside score 1 {scores[1]} or update 1 {updates[1]}"
    print(f"rollout 2 ran {beside:.1f} s beside iteration 1's score and update")

    client = MlflowClient(mlflow_url)
    run = client.search_runs([client.get_experiment_by_name("flyte-rlhf").experiment_id],
                             f"tags.storage LIKE '{root}/%'")[0]
    lag = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "rollout/policy_lag"))
    assert lag == [(0, 0.0), (1, 1.0), (2, 1.0)]
    assert run.info.status == "FINISHED"
