"""Critic-free RL as Flyte workflows — REINFORCE, RLOO, GRPO, Dr. GRPO, REINFORCE++ (``run.algorithm``):
``reinforce_iteration`` and ``reinforce_training``. Same tasks as PPO, no critic.

    pyflyte run workflows/reinforce.py reinforce_training --preset configs/tiny_grpo.yaml
"""

from __future__ import annotations

from typing import List

from flytekit import dynamic, workflow

from models.config import TrainConfig
from models.stages.finish import TrainingSummary
from tasks.iteration import finish_run, training_failed
from tasks.run_tasks import prepare_run
from models.run.types import PolicyState, RunHandle
from workflows.common import chain_iterations, wire_iteration


@workflow
def reinforce_iteration(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> PolicyState:
    """One critic-free iteration from ``state``; returns the state the next iteration starts from."""
    return wire_iteration(cfg, run, state, critic=False)


@dynamic
def reinforce_chunk(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> PolicyState:
    """Up to ``run.iterations_per_chunk`` iterations, then the next chunk."""
    state, more = chain_iterations(cfg, run, state, critic=False)
    return reinforce_chunk(cfg=cfg, run=run, state=state) if more else state


@workflow(on_failure=training_failed)
def reinforce_training(preset: str = "", overrides: List[str] = [], run_name: str = "") \
        -> TrainingSummary:
    """Train with a critic-free algorithm (run.algorithm: reinforce, rloo, grpo, dr_grpo or reinforce_pp).

    :param preset: YAML preset (a path, or a name under configs/); empty: configs/tiny_grpo.yaml for a new run
        (a resumed run keeps its stored config: docs/reliability.md)
    :param overrides: config overrides as section.field=value, e.g. ["run.algorithm=rloo"]
    :param run_name: run folder under run.storage_root; an existing run is resumed from its state.json (docs/reliability.md)
    """
    setup = prepare_run(preset=preset, overrides=overrides, run_name=run_name, workflow="reinforce")
    final = reinforce_chunk(cfg=setup.cfg, run=setup.run, state=setup.state)
    return finish_run(cfg=setup.cfg, run=setup.run, state=final)
