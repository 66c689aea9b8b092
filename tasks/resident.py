"""The iteration tasks of a resident run (``run.resident``): each sends its request to one of the run's
services (:mod:`models.resident`) and returns the typed output the stateless task returns. They import
neither torch nor vLLM (``tests/unit/test_thin_imports.py``), so their pods start in seconds on a CPU
node; the models stay in the services. Not cached: a service's state moves with every update."""

from __future__ import annotations

from flytekit import Resources, task

from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.resident import protocol
from models.run import lock as run_lock
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import RolloutOutput, ScoreOutput, UpdateOutput
from tasks import batch_type, secrets  # noqa: F401  (batch_type: RolloutBatch as a Flyte type)

THIN = dict(requests=Resources(cpu="500m", mem="1Gi"), secret_requests=secrets.requests(secrets.S3, secrets.MLFLOW))


def _batch_call(service: str, op: str, cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str,
                batch_uri=None, **extra):
    """``op`` of ``service``, started by ``launch`` (the run's lock holder, ``prepare_run``'s), on these inputs."""
    secrets.load(secrets.S3, secrets.MLFLOW)
    run = run.for_launch(launch)
    name = run_lock.execution_name(run.launch)  # on a cluster, wait for the service nodes of the run's launch
    protocol.expect_launch(name, 0.0 if name == "local" else cfg.run.resident_start_timeout_s)
    with run_lock.heartbeat(run.layout.lock_url, run.launch):
        out = protocol.call_service(run.layout, service, op, protocol.request_args(cfg, run, state, batch_uri, **extra))
    if isinstance(out, dict) and "stats" in out:  # JSON keeps 2.0 as 2.0 but a service's count may be an int
        out["stats"] = {k: float(v) for k, v in out["stats"].items()}
    return out


@task(**THIN)
def rollout_resident(cfg: TrainConfig, run: RunHandle, state: PolicyState, ahead: int = 0,
                     launch: str = "") -> RolloutOutput:
    """The engine service samples the iteration's batch from the actor it holds."""
    out = _batch_call(protocol.ENGINE, "rollout", cfg, run, state, launch, ahead=ahead)
    return RolloutOutput(RolloutBatch.open(out["batch"]), out["stats"])


@task(**THIN)
def score_resident(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
                   launch: str = "") -> ScoreOutput:
    """The actor service's ranks compute π_old and π_ref (the critic service the values) and the rewards."""
    out = _batch_call(protocol.ACTOR, "score", cfg, run, state, launch, batch.uri)
    return ScoreOutput(RolloutBatch.open(out["batch"]), out["stats"])


@task(**THIN)
def actor_update_resident(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
                          launch: str = "") -> UpdateOutput:
    """The actor service's update; its checkpoint every ``run.save_interval`` (else no URL); the new weights
    go to the engine service in memory."""
    out = _batch_call(protocol.ACTOR, "update", cfg, run, state, launch, batch.uri)
    return UpdateOutput(out["checkpoint_url"], out["stats"])


@task(**THIN)
def critic_update_resident(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
                           launch: str = "") -> UpdateOutput:
    """The critic service's update; its checkpoint every ``run.save_interval`` (else no URL)."""
    out = _batch_call(protocol.CRITIC, "update", cfg, run, state, launch, batch.uri)
    return UpdateOutput(out["checkpoint_url"], out["stats"])


@task(**THIN)
def evaluate_resident(cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str = "") -> float:
    """The engine service's mean reward on the held-out prompts (logged at the iteration that made the policy)."""
    return float(_batch_call(protocol.ENGINE, "evaluate", cfg, run, state, launch))
