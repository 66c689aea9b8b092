"""``advantages`` task (no GPU): the adapter of :func:`models.stages.advantages.run_advantages`."""

from __future__ import annotations

from flytekit import Resources, task

from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import AdvantagesOutput
from tasks import secrets
from tasks.caching import CACHED


@task(**CACHED, retries=2, requests=Resources(cpu="1", mem="2Gi"),
      secret_requests=secrets.requests(secrets.S3))
def advantages(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch) -> AdvantagesOutput:
    """Token rewards, advantages, returns and the loss mask for the algorithm in ``cfg``."""
    from models.stages.advantages import run_advantages  # torch: only where the task runs, not where it is compiled

    secrets.load(secrets.S3)
    return run_advantages(cfg, run, state, batch)
