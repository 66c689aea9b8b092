"""The iteration tasks of a resident run (``run.resident``): each runs its stage on one of the run's services
(:func:`models.stages.services.call_stage`: the services of the launch the run handle names, sent the iteration's
state and batch only) and returns the typed output the stateless task returns. They import neither torch nor
vLLM (``tests/unit/test_thin_imports.py``), so their pods start in seconds on a CPU node; the models stay in the
services. Not cached: a service's state moves with every update."""

from __future__ import annotations

from flytekit import Resources, task

from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.run import lock as run_lock
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import RolloutOutput, ScoreOutput, UpdateOutput
from models.stages.services import ACTOR, CRITIC, call_stage, generating_service
from tasks import batch_type, secrets  # noqa: F401  (batch_type: RolloutBatch as a Flyte type)

SECRETS = (secrets.S3, secrets.MLFLOW, secrets.SERVICE)
"""Storage, tracking, and the secret the services' token is derived from."""
THIN = dict(requests=Resources(cpu="500m", mem="1Gi"), secret_requests=secrets.requests(*SECRETS))


def _call(service: str, op: str, cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str, batch=None,
          **extra):
    """``op`` of the run's ``service``, started by ``launch`` (the holder of the run's lock, ``prepare_run``'s,
    whichever execution of the run this task runs in), on the iteration's state and batch."""
    secrets.load(*SECRETS)
    run = run.for_launch(launch)
    with run_lock.heartbeat(run.layout.lock_url, run.launch):
        return call_stage(cfg, run, service, op, state, batch, **extra)


@task(**THIN)
def rollout_resident(cfg: TrainConfig, run: RunHandle, state: PolicyState, ahead: int = 0,
                     launch: str = "") -> RolloutOutput:
    """The engine service (colocated: the actor trainer service's ranks) samples the iteration's batch from the
    actor it holds."""
    out = _call(generating_service(cfg), "rollout", cfg, run, state, launch, ahead=ahead)
    return RolloutOutput(RolloutBatch.open(out["batch"]), out["stats"])


@task(**THIN)
def score_resident(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
                   launch: str = "") -> ScoreOutput:
    """The actor service's ranks compute π_old and π_ref (the critic service the values) and the rewards."""
    out = _call(ACTOR, "score", cfg, run, state, launch, batch.uri)
    return ScoreOutput(RolloutBatch.open(out["batch"]), out["stats"])


@task(**THIN)
def actor_update_resident(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
                          launch: str = "") -> UpdateOutput:
    """The actor service's update; its checkpoint every ``run.save_interval`` (else no URL); the new weights
    go to the engine service in memory."""
    out = _call(ACTOR, "update", cfg, run, state, launch, batch.uri)
    return UpdateOutput(out["checkpoint_url"], out["stats"])


@task(**THIN)
def critic_update_resident(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
                           launch: str = "") -> UpdateOutput:
    """The critic service's update; its checkpoint every ``run.save_interval`` (else no URL)."""
    out = _call(CRITIC, "update", cfg, run, state, launch, batch.uri)
    return UpdateOutput(out["checkpoint_url"], out["stats"])


@task(**THIN)
def evaluate_resident(cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str = "") -> float:
    """The engine service's mean reward on the held-out prompts (logged at the iteration that made the policy)."""
    return float(_call(generating_service(cfg), "evaluate", cfg, run, state, launch))
