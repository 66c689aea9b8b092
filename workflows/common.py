"""Wiring shared by the PPO and the critic-free workflows (no task code here)."""

from __future__ import annotations

from typing import Optional, Tuple

from flytekitplugins.kfpytorch import Elastic

from tasks.advantages import advantages
from tasks.config import TrainConfig
from tasks.iteration import commit_iteration, evaluate
from tasks.rollout import rollout
from tasks.score import score
from tasks.updates import actor_update, critic_update


def elastic_for(cfg: TrainConfig) -> Elastic:
    a = cfg.actor
    return Elastic(nnodes=a.nnodes, nproc_per_node=a.nproc_per_node, max_restarts=a.max_restarts,
                   monitor_interval=1)


def wire_iteration(cfg, run, state, critic: bool, elastic: Optional[Elastic] = None):
    """rollout → score → advantages → actor_update (∥ critic_update) → commit_iteration."""
    ro = rollout(cfg=cfg, run=run, state=state)
    sc = score(cfg=cfg, run=run, state=state, batch=ro.batch)
    ad = advantages(cfg=cfg, run=run, state=state, batch=sc.batch)
    ac = actor_update(cfg=cfg, run=run, state=state, batch=ad.batch)
    if elastic is not None:
        ac.with_overrides(task_config=elastic)
    stats = [ro.stats, sc.stats, ad.stats, ac.stats]
    critic_url = ""
    if critic:
        cr = critic_update(cfg=cfg, run=run, state=state, batch=ad.batch)
        stats.append(cr.stats)
        critic_url = cr.checkpoint_url
    return commit_iteration(cfg=cfg, run=run, state=state, stats=stats, batch=sc.batch,
                            actor_url=ac.checkpoint_url, critic_url=critic_url)


def eval_due(cfg: TrainConfig, iteration: int) -> bool:
    last = iteration + 1 == cfg.run.num_iterations
    return cfg.run.eval_interval > 0 and ((iteration + 1) % cfg.run.eval_interval == 0 or last)


def chain_iterations(cfg: TrainConfig, run, state, critic: bool) -> Tuple[object, bool]:
    """Inside a dynamic workflow: up to ``run.iterations_per_chunk`` iterations from ``state``.

    Returns the last state and whether iterations remain (the caller recurses), so each
    sub-workflow stays far below Flyte's limit on nodes per workflow.
    """
    start = state.iteration
    stop = min(start + cfg.run.iterations_per_chunk, cfg.run.num_iterations)
    elastic = elastic_for(cfg)
    for i in range(start, stop):
        state = wire_iteration(cfg, run, state, critic, elastic)
        if eval_due(cfg, i):
            evaluate(cfg=cfg, run=run, state=state)
    return state, stop < cfg.run.num_iterations
