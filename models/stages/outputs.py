"""What the rollout, score and update stages return, torch-free: a resident run's thin tasks
(:mod:`tasks.resident`) return the same types as the stateless tasks without importing the stages."""

from __future__ import annotations

from typing import Dict, NamedTuple

from models.data.batch import RolloutBatch


class RolloutOutput(NamedTuple):
    batch: RolloutBatch
    stats: Dict[str, float]


class ScoreOutput(NamedTuple):
    batch: RolloutBatch
    stats: Dict[str, float]


class UpdateOutput(NamedTuple):
    checkpoint_url: str
    stats: Dict[str, float]
