"""PPO as Flyte workflows: ``ppo_iteration`` (one iteration) and ``ppo_training`` (a whole run).

    pyflyte run workflows/ppo.py ppo_training --preset configs/tiny_ppo.yaml \\
        --overrides '["run.num_iterations=20"]'

Wiring only: every task is in ``tasks/``.
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
def ppo_iteration(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> PolicyState:
    """One PPO iteration from ``state``; returns the state the next iteration starts from."""
    return wire_iteration(cfg, run, state, critic=True)


@dynamic
def ppo_chunk(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> PolicyState:
    """Up to ``run.iterations_per_chunk`` iterations, then the next chunk."""
    state, more = chain_iterations(cfg, run, state, critic=True)
    return ppo_chunk(cfg=cfg, run=run, state=state) if more else state


@workflow(on_failure=training_failed)
def ppo_training(preset: str = "", overrides: List[str] = [], run_name: str = "") \
        -> TrainingSummary:
    """Train with PPO (actor + critic).

    :param preset: YAML preset (a path, or a name under configs/); empty: configs/tiny_ppo.yaml for a new run
        (a resumed run keeps its stored config: docs/reliability.md)
    :param overrides: config overrides as section.field=value, e.g. ["actor.lr=1e-4", "run.num_iterations=50"]
    :param run_name: run folder under run.storage_root; an existing run is resumed from its state.json (docs/reliability.md)
    """
    setup = prepare_run(preset=preset, overrides=overrides, run_name=run_name, workflow="ppo")
    final = ppo_chunk(cfg=setup.cfg, run=setup.run, state=setup.state)
    return finish_run(cfg=setup.cfg, run=setup.run, state=final)
