"""``score`` and ``score_ranks`` tasks: the adapters of :func:`models.stages.score.run_score` (one process)
and of :func:`models.stages.score_ranks.score_ranks` (an elastic job on the actor's topology, the run's
choice with ``actor.score_on_ranks``)."""

from __future__ import annotations

from flytekit import task

from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import ScoreOutput
from models.stages.score import run_score
from models.stages.score_ranks import score_ranks as score_on_ranks
from tasks import decks, secrets
from tasks.caching import CACHED
from tasks.deploy import REGISTERED, elastic_for, resources_for


@task(**CACHED, retries=2, enable_deck=True, deck_fields=decks.DECK_FIELDS,
      secret_requests=secrets.requests(secrets.S3, secrets.SERVER), **resources_for(REGISTERED, "score"))
def score(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch) -> ScoreOutput:
    """Recompute π_old with the training-side actor, π_ref, critic values and rewards."""
    secrets.load(secrets.S3, secrets.SERVER)
    out = run_score(cfg, run, state, batch)
    decks.publish("Score", out.batch)
    return out


@task(task_config=elastic_for(REGISTERED), **CACHED, retries=2, enable_deck=True,
      deck_fields=decks.DECK_FIELDS, shared_memory=True, secret_requests=secrets.requests(secrets.S3, secrets.SERVER),
      **resources_for(REGISTERED, "score"))
def score_ranks(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch) -> ScoreOutput:
    """``score`` on ``actor.nnodes × actor.nproc_per_node`` processes (registered from the deployment config
    as the actor update; local runs take the run's), the models sharded as the actor update shards them,
    each rank scoring its share of the rows; rank 0 returns the output (the other ranks' is None)."""
    secrets.load(secrets.S3, secrets.SERVER)
    out = score_on_ranks(cfg, run, state, batch)
    if out is not None:
        decks.publish("Score", out.batch)
    return out  # type: ignore[return-value]  # rank 0's, the only one the launch returns
