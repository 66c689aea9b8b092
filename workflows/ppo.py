"""PPO as Flyte workflows: ``ppo_iteration`` (one iteration) and ``ppo_training`` (a whole run).

    pyflyte run workflows/ppo.py ppo_training --preset configs/tiny_ppo.yaml \
        --overrides '["run.num_iterations=20"]'

Wiring only: every task is in ``tasks/``.
"""

from __future__ import annotations

from typing import List, Optional

from flytekit import dynamic, workflow
from flytekitplugins.kfpytorch import Elastic

from tasks.advantages import advantages
from tasks.config import TrainConfig
from tasks.iteration import TrainingSummary, commit_iteration, evaluate, finish_run
from tasks.rollout import rollout
from tasks.run_tasks import prepare_run
from tasks.score import score
from tasks.types import PolicyState, RunHandle
from tasks.updates import actor_update, critic_update


def elastic_for(cfg: TrainConfig) -> Elastic:
    a = cfg.actor
    return Elastic(nnodes=a.nnodes, nproc_per_node=a.nproc_per_node, max_restarts=a.max_restarts,
                   monitor_interval=1)


def wire_iteration(cfg, run, state, elastic: Optional[Elastic] = None):
    """rollout → score → advantages → (actor_update ∥ critic_update) → commit."""
    ro = rollout(cfg=cfg, run=run, state=state)
    sc = score(cfg=cfg, run=run, state=state, batch=ro.batch)
    ad = advantages(cfg=cfg, run=run, state=state, batch=sc.batch)
    ac = actor_update(cfg=cfg, run=run, state=state, batch=ad.batch)
    if elastic is not None:
        ac.with_overrides(task_config=elastic)
    cr = critic_update(cfg=cfg, run=run, state=state, batch=ad.batch)
    return commit_iteration(cfg=cfg, run=run, state=state, stats=[ro.stats, sc.stats, ad.stats, ac.stats, cr.stats],
                            batch=sc.batch, actor_url=ac.checkpoint_url, critic_url=cr.checkpoint_url)


@workflow
def ppo_iteration(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> PolicyState:
    """One PPO iteration from ``state``; returns the state the next iteration starts from."""
    return wire_iteration(cfg, run, state)


def eval_due(cfg: TrainConfig, iteration: int) -> bool:
    last = iteration + 1 == cfg.run.num_iterations
    return cfg.run.eval_interval > 0 and ((iteration + 1) % cfg.run.eval_interval == 0 or last)


@dynamic
def ppo_chunk(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> PolicyState:
    """Up to ``run.iterations_per_chunk`` iterations, then the next chunk (keeps each graph small)."""
    start = state.iteration
    stop = min(start + cfg.run.iterations_per_chunk, cfg.run.num_iterations)
    elastic = elastic_for(cfg)
    for i in range(start, stop):
        state = wire_iteration(cfg, run, state, elastic)
        if eval_due(cfg, i):
            evaluate(cfg=cfg, run=run, state=state)
    if stop < cfg.run.num_iterations:
        state = ppo_chunk(cfg=cfg, run=run, state=state)
    return state


@workflow
def ppo_training(preset: str = "configs/tiny_ppo.yaml", overrides: List[str] = [], run_name: str = "") \
        -> TrainingSummary:
    """Train with PPO.

    :param preset: YAML preset (a path, or a name under configs/), e.g. configs/tiny_ppo.yaml
    :param overrides: config overrides as section.field=value, e.g. ["actor.lr=1e-4", "run.num_iterations=50"]
    :param run_name: run folder under run.storage_root; an existing run is resumed from its state.json
    """
    setup = prepare_run(preset=preset, overrides=overrides, run_name=run_name, algorithm="ppo")
    final = ppo_chunk(cfg=setup.cfg, run=setup.run, state=setup.state)
    return finish_run(cfg=setup.cfg, run=setup.run, state=final)
