"""``actor_update`` and ``critic_update`` (elastic torchrun jobs): the adapters of
:func:`models.stages.actor.train_actor_ranks` and :func:`models.stages.critic.train_critic_ranks`. They
run in parallel in the iteration graph."""

from __future__ import annotations

from flytekit import task

from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.run.types import PolicyState, RunHandle
from models.stages.actor import train_actor_ranks
from models.stages.critic import train_critic_ranks
from models.stages.outputs import UpdateOutput
from tasks import secrets
from tasks.caching import CACHED
from tasks.deploy import REGISTERED, elastic_for, resources_for


@task(task_config=elastic_for(REGISTERED), **CACHED, retries=1,
      shared_memory=True, secret_requests=secrets.requests(secrets.S3), **resources_for(REGISTERED, "actor"))
def actor_update(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
                 launch: str = "") -> UpdateOutput:
    """``ppo_epochs`` of clipped-surrogate updates over shuffled minibatches; next actor checkpoint.

    Runs as ``actor.nnodes × actor.nproc_per_node`` processes: registered from the deployment config
    (``tasks/deploy.py``); local runs take the run's config (the workflow overrides the elastic config).
    ``launch``: the holder of the run's lock, which rank 0 renews meanwhile (not in the cache key).
    """
    secrets.load(secrets.S3)
    return train_actor_ranks(cfg, run.for_launch(launch), state, batch)


@task(task_config=elastic_for(REGISTERED, section="critic"), **CACHED, retries=2,
      shared_memory=True, secret_requests=secrets.requests(secrets.S3, secrets.SERVER),
      **resources_for(REGISTERED, "critic"))
def critic_update(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch,
                  launch: str = "") -> UpdateOutput:
    """Clipped value regression on the same batch; next critic checkpoint.

    Runs as ``critic.nnodes × critic.nproc_per_node`` processes, registered and local as the actor's (one
    process by default: the task's own).
    """
    secrets.load(secrets.S3, secrets.SERVER)
    return train_critic_ranks(cfg, run.for_launch(launch), state, batch)
