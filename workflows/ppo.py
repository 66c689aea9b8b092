"""PPO as Flyte workflows: ``ppo_iteration`` (one iteration) and ``ppo_training`` (a whole run).

    pyflyte run workflows/ppo.py ppo_training --preset configs/tiny_ppo.yaml \\
        --overrides '["run.num_iterations=20"]'

The training workflows' definitions with a critic (``workflows/common.py``; the critic-free ones:
``workflows/reinforce.py``). Wiring only: every task is in ``tasks/``.
"""

from __future__ import annotations

from typing import List

from flytekit import dynamic, workflow

from models.config import TrainConfig
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import TrainingSummary
from tasks.iteration import training_failed
from workflows.common import next_chunk, train, wire_iteration

CRITIC = True
"""PPO trains a critic beside the actor."""


@workflow
def ppo_iteration(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> PolicyState:
    """One PPO iteration from ``state``; returns the state the next iteration starts from."""
    return wire_iteration(cfg, run, state, critic=CRITIC)


@dynamic
def ppo_chunk(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> PolicyState:
    """Up to ``run.iterations_per_chunk`` iterations, then the next chunk."""
    return next_chunk(ppo_chunk, cfg, run, state, critic=CRITIC)


@workflow(on_failure=training_failed)
def ppo_training(preset: str = "", overrides: List[str] = [], run_name: str = "") \
        -> TrainingSummary:
    """Train with PPO (actor + critic).

    :param preset: YAML preset (a path, or a name under configs/); empty: configs/tiny_ppo.yaml for a new run
        (a resumed run keeps its stored config: docs/reliability.md)
    :param overrides: config overrides as section.field=value, e.g. ["actor.lr=1e-4", "run.num_iterations=50"]
    :param run_name: run folder under run.storage_root; an existing run is resumed from its state.json (docs/reliability.md)
    """
    return train(ppo_chunk, "ppo", preset, overrides, run_name).summary
