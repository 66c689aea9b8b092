"""Checkpoint retention: which iterations' checkpoints and optimizer states a run keeps."""

from __future__ import annotations

from models import storage
from models.checkpoint.optimizer_state import optimizer_url
from models.config import TrainConfig
from models.run.types import RunHandle


def prune_checkpoints(cfg: TrainConfig, run: RunHandle, iteration: int) -> None:
    """Keep every ``save_interval``-th iteration's checkpoints and the newest; drop the one before (with
    ``run.off_policy_steps=1`` the one before that: the previous actor samples the next batch).
    Optimizer states are kept with the newest checkpoints only (the resume point's)."""
    for url in (run.layout.actor_url(iteration - 1), run.layout.critic_url(iteration - 1)) if iteration > 0 else ():
        storage.remove(optimizer_url(url), recursive=True)
    old = iteration - 1 - cfg.run.off_policy_steps
    if old >= 0 and (old + 1) % cfg.run.save_interval != 0:
        for url in (run.layout.actor_url(old), run.layout.critic_url(old)):
            storage.remove(url, recursive=True)
