"""PPO (one iteration), GRPO (three) and a colocated GRPO (one) from the compiled package, every node a pod
(``tests/cluster``), against the same seeds through a local ``pyflyte run``: the same checkpoints byte for byte, the same
metrics, every run FINISHED in one ``mlflow server`` on 127.0.0.1. PPO runs stateless (every task loads
its models), GRPO resident (``run.resident``): its services are nodes of the execution (the engine's pod,
the actor trainer's two-pod PyTorchJob), the local run's child processes of ``pyflyte run``; none outlives
its run. Every pod run is a chain of executions (the run's own, then its iterations': GRPO's two then one
(``run.iterations_per_execution=2``), each launched by the one before, as a long run is cut on a cluster), the
local runs one.

What differs on purpose: the pods' actor update is a two-node PyTorchJob (2 pods × 2 ranks, the
operator's rendezvous environment on loopback), the local run's one node of 4 ranks (the same 4
ranks, the same shards); the PPO run loses its rollout pod mid-sampling and Flyte's retry
redoes it; the GRPO run loses its engine service's pod mid-sampling (iteration 1's batch sampled, not
written): Flyte starts it again from the run's start and the iteration's tasks go on with it, given the
trainer's weights, no iteration redone. The colocated case (``run.resident_layout=colocated``, the HF engine)
has no engine at all beside its actor trainer's PyTorchJob: each of its 4 ranks samples its share of the prompts
and loads the new weights in its own process. Both sides run one torch thread per process (each node limited to one core), as float
sums depend on the thread count.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cluster.conftest import CRITIC_TOPOLOGY, DEPLOY, TOPOLOGY, registration_env
from tests.cluster.harness import Fault
from tests.conftest import BUCKET
from tests.integration.flyte_runs import FlyteRun, isolated_env
from tests.processes import s3_client_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COMMON = ["run.num_iterations=2", "run.iterations_per_chunk=1", "run.eval_interval=2", "run.save_interval=1",
          "rollout.prompts_per_iteration=8", "actor.minibatch_size=16", "data.num_demo_eval_prompts=8"]
ONE_ITERATION = [o for o in COMMON if not o.startswith("run.num_iterations")] + ["run.num_iterations=1"]
RUN = {"ppo": [o for o in ONE_ITERATION if not o.startswith("run.eval_interval")]
       + ["run.eval_interval=0", "critic.minibatch_size=16", "critic.micro_batch_size=8", "rollout.engine=hf"],
       "grpo": [o for o in COMMON if not o.startswith(("run.iterations_per_chunk", "run.num_iterations"))]
       + ["run.num_iterations=3", "run.iterations_per_chunk=2", "run.iterations_per_execution=2",
          "run.off_policy_steps=1", "actor.tis_cap=2", "run.resident=true", "run.resident_idle_timeout_s=600"],
       "colocated": ONE_ITERATION + ["rollout.engine=hf", "run.resident=true", "run.resident_layout=colocated",
                                     "run.resident_idle_timeout_s=600"]}
ITERATIONS = {"ppo": 1, "grpo": 3, "colocated": 1}
EXECUTIONS = {"ppo": 2, "grpo": 3, "colocated": 2}
"""The run's own execution (set-up, services, finish) and those of its iterations: PPO's one of its iteration,
GRPO's of iterations 0-1 (pipelined in one chunk) and of iteration 2, the colocated run's of its iteration."""
"""The critic's options only where there is a critic (an option the algorithm ignores is refused); PPO samples
with the HF engine (its rollout pods start in seconds: nothing here depends on the engine) and evaluates nothing
(its stateless evaluation pod was the same engine load as its rollout pod's; the GRPO and colocated cases evaluate
in their services),
GRPO with vLLM, so vLLM runs in pods from the package too (in the engine service's pod). GRPO
runs resident and pipelined (``run.off_policy_steps=1``, docs/off_policy.md) with two ready nodes at a time
on each level of the graph, as propeller runs them: the same checkpoints and metrics as the local run, which
executes nodes one after another, and its rollout of iteration 1 beside iteration 0's chain (both
iterations in one chunk: the pipeline restarts at a chunk's first iteration, as in the execution of iteration 2,
whose first batch is sampled from the actor of iteration 0 as the pipeline would have)."""
PODS_TOPOLOGY = {"ppo": TOPOLOGY + CRITIC_TOPOLOGY, "grpo": TOPOLOGY, "colocated": TOPOLOGY}
"""The registered topologies: the actor's 2 pods of 2 ranks and, for PPO, the critic's 2 pods of 1 rank."""
LOCAL_TOPOLOGY = {"ppo": ["actor.nnodes=1", "actor.nproc_per_node=4", "actor.micro_batch_size=4",
                          "critic.nnodes=1", "critic.nproc_per_node=2"],
                  "grpo": ["actor.nnodes=1", "actor.nproc_per_node=4", "actor.micro_batch_size=4"]}
LOCAL_TOPOLOGY["colocated"] = LOCAL_TOPOLOGY["grpo"]
"""The same world sizes on one node: the local run the pods must match file for file."""
CASES = {"ppo": ("workflows/ppo.py", "ppo_training", "configs/tiny_ppo.yaml"),
         "grpo": ("workflows/reinforce.py", "reinforce_training", "configs/tiny_grpo.yaml")}
CASES["colocated"] = CASES["grpo"]
NOT_COMPARED = ("time/", "throughput/", "resident/sleep_s", "resident/wake_s", "resident/push_s")
"""Wall-clock metrics: never equal between two runs."""


def committed_files(store_fs, url: str) -> dict:
    with store_fs.open(f"{url}/COMMITTED.json") as f:
        return json.load(f)["files"]


def metrics(client, run_id: str) -> dict:
    keys = [k for k in client.get_run(run_id).data.metrics if not k.startswith(NOT_COMPARED)]
    return {k: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, k), key=lambda m: m.step)]
            for k in keys}


def local_run(algo: str, root: str, s3: str, mlflow: str, home: Path) -> str:
    workflow, entry, preset = CASES[algo]
    # HF_HUB_OFFLINE as the image sets it: transformers writes it into every saved tokenizer_config.json
    # ("local_files_only"), so without it the checkpoints differ in that one file (weights equal).
    env = isolated_env(home, {**s3_client_env(s3), "MLFLOW_TRACKING_URI": mlflow, "OMP_NUM_THREADS": "1",
                              "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    run = FlyteRun(workflow, entry, preset, RUN[algo] + LOCAL_TOPOLOGY[algo] + [f"run.storage_root={root}"], "local", env,
                   home / "pyflyte.log")
    return run.wait(timeout_s=1800)


@pytest.mark.parametrize("algo", ["ppo", "grpo", "colocated"])
def test_a_run_across_executions_in_pods_matches_a_local_run(algo, packages, make_cluster, s3_server, mlflow_url, tmp_path):
    from mlflow.tracking import MlflowClient

    package = packages(*DEPLOY, registration_env(s3_server, mlflow_url))
    faults = {"ppo": [Fault("rollout", "rollout/iter-000000")],
              "grpo": [Fault("engine_service", "rollout/iter-000001")]}.get(algo, [])
    cluster = make_cluster(package, faults=faults, **({"parallelism": 2, "pin_cores": (0, 1)} if algo != "ppo" else {}))
    root = f"s3://{BUCKET}/{algo}-{tmp_path.name}"
    workflow, entry, preset = CASES[algo]
    ex = cluster.execute(f"workflows.{Path(workflow).stem}.{entry}",
                         {"preset": preset, "overrides": RUN[algo] + PODS_TOPOLOGY[algo] + [f"run.storage_root={root}"],
                          "run_name": "pods"})
    report = "\n".join(f"{a.node:18s} {a.task:36s} try {a.attempt} {a.outcome:8s} {a.seconds:6.1f} s {a.error[:200]}"
                       for a in ex.attempts)
    print(report)
    assert not ex.error, f"{ex.error}\n{report}"
    local_run(algo, root, s3_server, mlflow_url, tmp_path / "local")

    fs = cluster.store.fs()
    differ = []
    for i in range(ITERATIONS[algo]):
        for what in ["actor"] + (["critic"] if algo == "ppo" else []):
            pods_files = committed_files(fs, f"{root}/pods/iter-{i:06d}/{what}")
            local_files = committed_files(fs, f"{root}/local/iter-{i:06d}/{what}")
            differ += [f"iter-{i:06d}/{what}/{f}" for f in set(pods_files) | set(local_files)
                       if pods_files.get(f) != local_files.get(f)]
    client = MlflowClient(mlflow_url)
    runs = {r.info.run_name: r for r in client.search_runs(
        [client.get_experiment_by_name("flyte-rlhf").experiment_id], f"tags.storage LIKE '{root}/%'")}
    assert set(runs) == {"pods", "local"} and {r.info.status for r in runs.values()} == {"FINISHED"}
    pods_m, local_m = metrics(client, runs["pods"].info.run_id), metrics(client, runs["local"].info.run_id)
    differ += [f"{k}: pods {pods_m.get(k)} local {local_m.get(k)}" for k in set(pods_m) | set(local_m)
               if pods_m.get(k) != local_m.get(k)]
    assert not differ, "\n".join(sorted(differ))  # every checkpoint file and metric, not the first that differs
    assert ("eval/reward_mean" in pods_m) == (algo != "ppo") and len(pods_m["rollout/reward_mean"]) == ITERATIONS[algo]
    built = cluster.pods.image_env["RLHF_GIT_COMMIT"]  # the image's build argument: HEAD when the test began
    assert runs["pods"].data.tags["git_commit"] == built and len(built) == 40

    folders = [p.folder for a in ex.attempts for p in a.pods]
    assert len(set(folders)) == len(folders)  # each pod worked in its own folder
    check_executions(ex, EXECUTIONS[algo])
    if algo == "ppo":
        check_stateless_pods(ex)
    if algo == "grpo":
        check_services(ex, cluster, root)
        check_pipelined(ex, client, runs["pods"].info.run_id, "_resident")
    if algo == "colocated":
        check_colocated(ex, pods_m)


def check_executions(ex, count: int) -> None:
    """The run was a chain of ``count`` executions, each launched by the one before (the first by the run's
    own, which holds only its set-up, services and finish), each recording its own nodes only: the largest
    record holds a few iterations' nodes, however long the run."""
    chain = ex.chain()
    records = {e.id: e.nodes for e in chain}
    print("executions (nodes of each record):", records)
    assert len(chain) == count and [e.parent for e in chain[1:]] == [e.id for e in chain[:-1]], chain
    assert [e.workflow.rsplit(".", 1)[-1] for e in chain[1:]] == [chain[1].workflow.rsplit(".", 1)[-1]] * (count - 1)
    assert chain[0].nodes <= 7 and max(records.values()) <= 40, records  # (7: set-up, 3 services, the plan, finish)


def check_colocated(ex, pods_m: dict) -> None:
    """``run.resident_layout=colocated``: the actor trainer's PyTorchJob (2 pods of 2 ranks) is the run's one
    service, its ranks the engines (no engine node, no task that loads a model); no weight bytes travelled, and the
    update's weights were loaded in process."""
    services = sorted({a.task.rsplit(".", 1)[-1] for a in ex.attempts if a.task.endswith("_service")})
    assert services == ["actor_service"], services
    actor = [a for a in ex.attempts if a.task.endswith(".actor_service")][-1]
    assert actor.outcome == "outputs" and len(actor.pods) == 2, (actor.outcome, actor.error)
    assert not [a for a in ex.attempts if a.task.split(".")[-1] in ("rollout", "score", "actor_update")]
    assert [v for _, v in pods_m["resident/weights_bytes"]] == [0.0] * ITERATIONS["colocated"]
    # the update's weights loaded into the ranks' engines in process (before the final evaluation samples)
    assert [v > 0 for _, v in pods_m["resident/weights_loaded_bytes"]] == [True] * ITERATIONS["colocated"]


def check_stateless_pods(ex) -> None:
    """The two-node update ran as 2 pods, each sharing one download of the checkpoint it trains between its
    ranks (iteration 0's actor, the reference); the lost rollout pod's node ran again and went on."""
    updates = [a for a in ex.attempts if a.task.endswith("actor_update")]
    assert [len(a.pods) for a in updates] == [2]
    # the critic update: a PyTorchJob of 2 pods too, matching the local 2-rank critic
    assert [len(a.pods) for a in ex.attempts if a.task.endswith("critic_update")] == [2]
    for pod in updates[0].pods:
        cache = pod.folder / "tmp" / "flyte-rlhf-checkpoints"
        assert len([d for d in os.listdir(cache) if not d.startswith(".") and os.path.isdir(cache / d)]) == 1
    rollouts = [(a.node, a.outcome) for a in ex.attempts if a.task.endswith(".rollout")]
    assert [o for _, o in rollouts] == ["lost", "outputs"] and rollouts[0][0] == rollouts[1][0]


def check_services(ex, cluster, root: str) -> None:
    """A resident run's services were nodes of its execution: the engine one pod, the actor trainer a
    PyTorchJob of the registered 2 pods; each served the run's thin tasks and ended because ``finish_run``
    stopped it (not its idle timeout, not a kill), before the execution ended; their addresses are gone.
    No task loaded a model: the iteration's pods are the thin ones."""
    from models.service import book

    services = {a.task.rsplit(".", 1)[-1]: a for a in ex.attempts if a.task.endswith("_service")}  # the last try
    assert sorted(services) == ["actor_service", "engine_service"], sorted(services)
    engines = [a.outcome for a in ex.of_task(".engine_service")]
    assert engines == ["lost", "outputs"], engines  # its pod lost mid-sampling, started again by Flyte's retry
    assert len(services["actor_service"].pods) == 2 and len(services["engine_service"].pods) == 1
    finished = max(p.started + p.seconds for a in ex.of_task(".finish_run") for p in a.pods)
    for name, a in services.items():
        assert a.outcome == "outputs" and all(p.exit_code == 0 for p in a.pods), (name, a.error)
        assert "stopping: the run finished" in a.pods[0].output(), a.pods[0].output()[-2000:]
        assert max(p.started + p.seconds for p in a.pods) <= finished + 60  # ended with the run, not idle
        assert all(p.proc.poll() is not None for p in a.pods)
        summary = service_summary(cluster, ex, a)
        assert summary.name == name.split("_")[0] and summary.stopped == "the run finished", summary
        assert summary.requests >= {"engine_service": 3, "actor_service": 4}[name], summary  # its ops and the stop
    assert not cluster.store.fs().exists(book.address_url(f"{root}/pods", "engine"))
    assert not [a for a in ex.attempts if a.task.split(".")[-1] in ("rollout", "score", "actor_update")]


def spans(ex, task: str):
    """``[(start, end)]`` in monotonic seconds of the node attempts of ``task``, by start (all pods of each)."""
    return sorted((min(p.started for p in a.pods), max(p.started + p.seconds for p in a.pods))
                  for a in ex.of_task(task) if a.pods)


def overlap(a, b) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def service_summary(cluster, ex, a):
    """The :class:`~models.stages.outputs.ServiceSummary` a service node returned (its ``outputs.pb``)."""
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import Literal

    from models.stages.outputs import ServiceSummary

    doc = cluster.store.read_literals(f"{cluster.metadata_prefix}/{ex.id}/{a.node}/data/{a.attempt}/outputs.pb")
    return TypeEngine.to_python_value(FlyteContextManager.current_context(), Literal.from_flyte_idl(doc.literals["o0"]),
                                     ServiceSummary)


def check_pipelined(ex, client, run_id: str, suffix: str = "") -> None:
    """With ``run.off_policy_steps=1`` the rollout of iteration 1 (sampled from the initial actor) needs
    nothing of iteration 0: it runs beside iteration 0's rollout, score or update, which an on-policy graph
    never allows (every rollout waits for the commit before it); ``rollout/policy_lag`` is 0, then 1 (iteration 2's
    batch too, sampled at its execution's start from the actor of iteration 0).
    ``suffix``: ``_resident`` for a resident run's thin tasks."""
    rollouts = spans(ex, ".rollout" + suffix)
    chain = rollouts[:1] + spans(ex, ".score" + suffix)[:1] + spans(ex, ".actor_update" + suffix)[:1]
    assert len(rollouts) == 3  # iterations 0 and 1 (pipelined), 2 (its execution's first)
    beside = sum(overlap(rollouts[1], other) for other in chain)
    assert beside > 0, f"rollout 1 {rollouts[1]} never ran beside iteration 0's chain {chain}"
    print(f"rollout 1 ran {beside:.1f} s beside iteration 0's rollout, score and update")
    lag = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "rollout/policy_lag"))
    assert lag == [(0, 0.0), (1, 1.0), (2, 1.0)]
