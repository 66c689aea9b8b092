"""Critic-free RL as Flyte workflows — REINFORCE, RLOO, GRPO, Dr. GRPO, REINFORCE++ (``run.algorithm``):
``reinforce_iteration`` and ``reinforce_training``.

    pyflyte run workflows/reinforce.py reinforce_training --preset configs/tiny_grpo.yaml

The training workflows' definitions without a critic (``workflows/common.py``; with one:
``workflows/ppo.py``). Wiring only: every task is in ``tasks/``.
"""

from __future__ import annotations

from typing import List

from flytekit import dynamic, workflow

from models.config import TrainConfig
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import TrainingSummary
from tasks.iteration import training_failed
from workflows.common import next_chunk, train, wire_iteration

CRITIC = False
"""The critic-free algorithms train the actor alone."""


@workflow
def reinforce_iteration(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> PolicyState:
    """One critic-free iteration from ``state``; returns the state the next iteration starts from."""
    return wire_iteration(cfg, run, state, critic=CRITIC)


@dynamic
def reinforce_chunk(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> PolicyState:
    """Up to ``run.iterations_per_chunk`` iterations, then the next chunk."""
    return next_chunk(reinforce_chunk, cfg, run, state, critic=CRITIC)


@workflow(on_failure=training_failed)
def reinforce_training(preset: str = "", overrides: List[str] = [], run_name: str = "") \
        -> TrainingSummary:
    """Train with a critic-free algorithm (run.algorithm: reinforce, rloo, grpo, dr_grpo or reinforce_pp).

    :param preset: YAML preset (a path, or a name under configs/); empty: configs/tiny_grpo.yaml for a new run
        (a resumed run keeps its stored config: docs/reliability.md)
    :param overrides: config overrides as section.field=value, e.g. ["run.algorithm=rloo"]
    :param run_name: run folder under run.storage_root; an existing run is resumed from its state.json (docs/reliability.md)
    """
    return train(reinforce_chunk, "reinforce", preset, overrides, run_name).summary
