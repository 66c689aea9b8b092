"""Critic-free RL as Flyte workflows — REINFORCE, RLOO, GRPO, Dr. GRPO, REINFORCE++ (``run.algorithm``):
``reinforce_iteration`` and ``reinforce_training``.

    pyflyte run workflows/reinforce.py reinforce_training --preset configs/tiny_grpo.yaml

The training workflows' definitions without a critic (``workflows/common.py``; with one:
``workflows/ppo.py``). Wiring only: every task is in ``tasks/``.
"""

from __future__ import annotations

from typing import List

from flytekit import LaunchPlan, dynamic, workflow

from models.config import TrainConfig
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import TrainingSummary
from tasks.iteration import training_failed
from workflows.common import chain_iterations, run_execution, train, wire_iteration

CRITIC = False
"""The critic-free algorithms train the actor alone."""


@workflow
def reinforce_iteration(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> PolicyState:
    """One critic-free iteration from ``state``; returns the state the next iteration starts from."""
    return wire_iteration(cfg, run, state, critic=CRITIC)


@dynamic
def reinforce_chunk(cfg: TrainConfig, run: RunHandle, state: PolicyState, stop: int, launch: str) -> PolicyState:
    """Iterations ``state.iteration`` … ``stop - 1`` (at most ``run.iterations_per_chunk``)."""
    return chain_iterations(cfg, run, state, CRITIC, stop, launch)


@dynamic
def reinforce_iterations(cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str) -> PolicyState:
    """Up to ``run.iterations_per_execution`` iterations in chunks, then the next execution of the run."""
    return run_execution(reinforce_chunk, reinforce_execution_plan, cfg, run, state, launch)


@workflow
def reinforce_execution(cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str) -> PolicyState:
    """One execution of a run's iterations from ``state`` (the run's first, then each launching the next);
    the state after the run's last iteration. ``launch``: the holder of the run's lock."""
    return reinforce_iterations(cfg=cfg, run=run, state=state, launch=launch)


reinforce_execution_plan = LaunchPlan.get_or_create(reinforce_execution)
"""The default launch plan of :func:`reinforce_execution`: a node of it is a new Flyte execution."""


@workflow(on_failure=training_failed)
def reinforce_training(preset: str = "", overrides: List[str] = [], run_name: str = "") \
        -> TrainingSummary:
    """Train with a critic-free algorithm (run.algorithm: reinforce, rloo, grpo, dr_grpo or reinforce_pp).

    :param preset: YAML preset (a path, or a name under configs/); empty: configs/tiny_grpo.yaml for a new run
        (a resumed run keeps its stored config: docs/reliability.md)
    :param overrides: config overrides as section.field=value, e.g. ["run.algorithm=rloo"]
    :param run_name: run folder under run.storage_root; an existing run is resumed from its state.json (docs/reliability.md)
    """
    return train(reinforce_execution_plan, "reinforce", preset, overrides, run_name).summary
