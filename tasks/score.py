"""``score`` task: the adapter of :func:`models.stages.score.run_score`."""

from __future__ import annotations

from flytekit import task

from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.run.types import PolicyState, RunHandle
from models.stages.score import ScoreOutput, run_score
from tasks import decks, secrets
from tasks.caching import CACHE_VERSION
from tasks.deploy import REGISTERED, resources_for


@task(cache=True, cache_version=CACHE_VERSION, retries=2, enable_deck=True, deck_fields=decks.DECK_FIELDS,
      secret_requests=secrets.requests(secrets.S3, secrets.SERVER), **resources_for(REGISTERED, "score"))
def score(cfg: TrainConfig, run: RunHandle, state: PolicyState, batch: RolloutBatch) -> ScoreOutput:
    """Recompute π_old with the training-side actor, π_ref, critic values and rewards."""
    secrets.load(secrets.S3, secrets.SERVER)
    out = run_score(cfg, run, state, batch)
    decks.publish("Score", out.batch)
    return out
