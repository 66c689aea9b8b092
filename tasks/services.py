"""A resident run's services on a Flyte cluster (``run.resident``), as nodes of the run's own execution:
``engine_service`` (a GPU task with the rollout's resources), ``actor_service`` (the elastic PyTorchJob of
the actor's registered topology: every rank holds its shard) and, for PPO, ``critic_service`` (the critic's
topology). The training workflow starts them beside its iterations (``workflows/common.py``); each loads
its models from the state the run starts or resumes at, publishes its address under the run folder with
a fresh token and serves the iteration's thin tasks (``tasks/resident.py``) until ``finish_run`` stops it,
then returns its :class:`~models.stages.outputs.ServiceSummary`. When the run fails, Flyte aborts them with
the execution; ``run.resident_idle_timeout_s`` is the backstop. Each listens on its pod's address only and accepts
only the token derived from the Flyte secret ``flyte-rlhf/service-secret`` (published nowhere). The engine's node
is retried (:data:`ENGINE_RETRIES`): a new pod starts from the run's starting state, publishes its new address and
gets the trainer's current weights from its callers (``models/stages/services.py``). The trainers are not: one that
died would come back at the run's start, not where the run is (torch elastic's restarts are off, ``max_restarts=0``);
the execution fails instead and a rerun resumes from the last checkpoint.

Locally the same services run as child processes of ``pyflyte run`` (``models/hosts/resident.py``).
"""

from __future__ import annotations

import dataclasses

from flytekit import task

from models.config import TrainConfig
from models.hosts.resident import cluster_addresses, serve_service
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import ServiceSummary
from models.stages.services import ACTOR, CRITIC, ENGINE
from tasks import secrets
from tasks.deploy import REGISTERED, elastic_for, resources_for

SECRETS = (secrets.S3, secrets.MLFLOW, secrets.SERVER, secrets.SERVICE)
ENGINE_RETRIES = 2
"""How often Flyte starts the engine service's pod again after it failed."""


def _serve(name: str, cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str) -> ServiceSummary:
    secrets.load(*SECRETS)
    listen, advertise = cluster_addresses()  # the pod's address; no process to watch
    return serve_service(name, cfg, run.for_launch(launch), state, listen=listen, advertise=advertise)


def service_elastic(section: str):
    """A trainer service's launch: the registered topology, never restarted by torch elastic."""
    return dataclasses.replace(elastic_for(REGISTERED, section=section), max_restarts=0)


@task(retries=ENGINE_RETRIES, secret_requests=secrets.requests(*SECRETS), **resources_for(REGISTERED, "rollout"))
def engine_service(cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str = "") -> ServiceSummary:
    """The generation engine of the run: rollout and evaluation, new actor weights in memory."""
    return _serve(ENGINE, cfg, run, state, launch)


@task(task_config=service_elastic("actor"), retries=0, shared_memory=True, secret_requests=secrets.requests(*SECRETS),
      **resources_for(REGISTERED, "actor"))
def actor_service(cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str = "") -> ServiceSummary:
    """The actor trainer: ``actor.nnodes × actor.nproc_per_node`` ranks holding the actor, AdamW's state and
    π_ref; scores and updates."""
    return _serve(ACTOR, cfg, run, state, launch)


@task(task_config=service_elastic("critic"), retries=0, shared_memory=True,
      secret_requests=secrets.requests(*SECRETS), **resources_for(REGISTERED, "critic"))
def critic_service(cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str = "") -> ServiceSummary:
    """PPO's critic trainer on the critic's topology: values and updates."""
    return _serve(CRITIC, cfg, run, state, launch)
