"""PPO as Flyte workflows: ``ppo_iteration`` (one iteration) and ``ppo_training`` (a whole run).

    pyflyte run workflows/ppo.py ppo_training --preset configs/tiny_ppo.yaml \\
        --overrides '["run.num_iterations=20"]'

The training workflows' definitions with a critic (``workflows/common.py``; the critic-free ones:
``workflows/reinforce.py``). Wiring only: every task is in ``tasks/``.
"""

from __future__ import annotations

from typing import List

from flytekit import LaunchPlan, dynamic, workflow

from models.config import TrainConfig
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import TrainingSummary
from tasks.iteration import training_failed
from workflows.common import chain_iterations, run_execution, train, wire_iteration

CRITIC = True
"""PPO trains a critic beside the actor."""


@workflow
def ppo_iteration(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> PolicyState:
    """One PPO iteration from ``state``; returns the state the next iteration starts from."""
    return wire_iteration(cfg, run, state, critic=CRITIC)


@dynamic
def ppo_chunk(cfg: TrainConfig, run: RunHandle, state: PolicyState, stop: int, launch: str) -> PolicyState:
    """Iterations ``state.iteration`` … ``stop - 1`` (at most ``run.iterations_per_chunk``)."""
    return chain_iterations(cfg, run, state, CRITIC, stop, launch)


@dynamic
def ppo_iterations(cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str) -> PolicyState:
    """Up to ``run.iterations_per_execution`` iterations in chunks, then the next execution of the run."""
    return run_execution(ppo_chunk, ppo_execution_plan, cfg, run, state, launch)


@workflow
def ppo_execution(cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str) -> PolicyState:
    """One execution of a run's iterations from ``state`` (the run's first, then each launching the next);
    the state after the run's last iteration. ``launch``: the holder of the run's lock."""
    return ppo_iterations(cfg=cfg, run=run, state=state, launch=launch)


ppo_execution_plan = LaunchPlan.get_or_create(ppo_execution)
"""The default launch plan of :func:`ppo_execution`: a node of it is a new Flyte execution."""


@workflow(on_failure=training_failed)
def ppo_training(preset: str = "", overrides: List[str] = [], run_name: str = "") \
        -> TrainingSummary:
    """Train with PPO (actor + critic).

    :param preset: YAML preset (a path, or a name under configs/); empty: configs/tiny_ppo.yaml for a new run
        (a resumed run keeps its stored config: docs/reliability.md)
    :param overrides: config overrides as section.field=value, e.g. ["actor.lr=1e-4", "run.num_iterations=50"]
    :param run_name: run folder under run.storage_root; an existing run is resumed from its state.json (docs/reliability.md)
    """
    return train(ppo_execution_plan, "ppo", preset, overrides, run_name).summary
