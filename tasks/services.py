"""A resident run's services on a Flyte cluster (``run.resident``), as nodes of the run's own execution:
``engine_service`` (a GPU task with the rollout's resources), ``actor_service`` (the elastic PyTorchJob of
the actor's registered topology: every rank holds its shard) and, for PPO, ``critic_service`` (the critic's
topology). The training workflow starts them beside its iterations (``workflows/common.py``); each loads
its models from the state the run starts or resumes at, publishes its address under the run folder with
a fresh token and serves the iteration's thin tasks (``tasks/resident.py``) until ``finish_run`` stops it,
then returns its :class:`~models.stages.outputs.ServiceSummary`. When the run fails, Flyte aborts them with
the execution; ``run.resident_idle_timeout_s`` is the backstop. No retries: a service that died would come
back at the run's start, not where the run is; the execution fails instead and a rerun resumes.

Locally the same services run as child processes of ``pyflyte run`` (``models/hosts/resident.py``).
"""

from __future__ import annotations

from flytekit import task

from models.config import TrainConfig
from models.hosts.resident import cluster_addresses, serve_service
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import ServiceSummary
from models.stages.services import ACTOR, CRITIC, ENGINE
from tasks import secrets
from tasks.deploy import REGISTERED, elastic_for, resources_for

SECRETS = (secrets.S3, secrets.MLFLOW, secrets.SERVER)


def _serve(name: str, cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str) -> ServiceSummary:
    secrets.load(*SECRETS)
    listen, advertise = cluster_addresses()  # a fresh token, published with the address; no process to watch
    return serve_service(name, cfg, run.for_launch(launch), state, listen=listen, advertise=advertise)


@task(retries=0, secret_requests=secrets.requests(*SECRETS), **resources_for(REGISTERED, "rollout"))
def engine_service(cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str = "") -> ServiceSummary:
    """The generation engine of the run: rollout and evaluation, new actor weights in memory."""
    return _serve(ENGINE, cfg, run, state, launch)


@task(task_config=elastic_for(REGISTERED), retries=0, shared_memory=True, secret_requests=secrets.requests(*SECRETS),
      **resources_for(REGISTERED, "actor"))
def actor_service(cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str = "") -> ServiceSummary:
    """The actor trainer: ``actor.nnodes × actor.nproc_per_node`` ranks holding the actor, AdamW's state and
    π_ref; scores and updates."""
    return _serve(ACTOR, cfg, run, state, launch)


@task(task_config=elastic_for(REGISTERED, section="critic"), retries=0, shared_memory=True,
      secret_requests=secrets.requests(*SECRETS), **resources_for(REGISTERED, "critic"))
def critic_service(cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str = "") -> ServiceSummary:
    """PPO's critic trainer on the critic's topology: values and updates."""
    return _serve(CRITIC, cfg, run, state, launch)
