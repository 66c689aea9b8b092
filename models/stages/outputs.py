"""What the rollout, score, advantages, update and finish stages return, torch-free: a resident run's thin tasks
(:mod:`tasks.resident`) return the same types as the stateless tasks without importing the stages, and a pod that
only compiles the graph (a dynamic workflow's, a launch plan's) imports the task modules without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, NamedTuple

from models.data.batch import RolloutBatch


class RolloutOutput(NamedTuple):
    batch: RolloutBatch
    stats: Dict[str, float]


class ScoreOutput(NamedTuple):
    batch: RolloutBatch
    stats: Dict[str, float]


class AdvantagesOutput(NamedTuple):
    batch: RolloutBatch
    stats: Dict[str, float]


class UpdateOutput(NamedTuple):
    checkpoint_url: str
    stats: Dict[str, float]


@dataclass(frozen=True)
class TrainingSummary:
    """What a finished run reports."""

    run_url: str
    mlflow_run_id: str
    iterations: int
    reward_first: float
    reward_last: float
    final_actor_url: str
    registered_model: str = ""
    """Model Registry name of the final policy ("" when not registered)."""
    model_version: str = ""
    """Its version (alias ``candidate``)."""


@dataclass(frozen=True)
class ServiceSummary:
    """What a resident service reports when it stops (``run.resident`` on a cluster: the output of its node)."""

    name: str
    """``engine``, ``actor`` or ``critic``."""
    requests: int
    """Requests it served (the stop request included)."""
    seconds: float
    """From listening to stopping (its models' load not included)."""
    stopped: str
    """Why it stopped: the run finished, or its idle timeout."""
