"""``rollout`` task: the adapter of :func:`models.stages.rollout.run_rollout`."""

from __future__ import annotations

from flytekit import task

from models.config import TrainConfig
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import RolloutOutput
from models.stages.rollout import run_rollout
from tasks import decks, secrets
from tasks.caching import CACHED
from tasks.deploy import REGISTERED, resources_for


@task(**CACHED, retries=2, enable_deck=True, deck_fields=decks.DECK_FIELDS,
      secret_requests=secrets.requests(secrets.S3, secrets.SERVER), **resources_for(REGISTERED, "rollout"))
def rollout(cfg: TrainConfig, run: RunHandle, state: PolicyState, ahead: int = 0) -> RolloutOutput:
    """Sample ``n_samples_per_prompt`` responses per prompt with vLLM (or HF) from the actor (for the
    iteration ``ahead`` after ``state``'s: off-policy pipelining)."""
    secrets.load(secrets.S3, secrets.SERVER)
    out = run_rollout(cfg, run, state, ahead)
    decks.publish("Rollout", out.batch)
    return out
