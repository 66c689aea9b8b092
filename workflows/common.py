"""The training workflows, defined once: PPO (``workflows/ppo.py``) and the critic-free algorithms
(``workflows/reinforce.py``) differ only by whether a critic runs, so each module binds the same three
definitions under its own names (Flyte names a workflow after the module attribute that holds it):

- one iteration, :func:`wire_iteration`: rollout → score → advantages → actor_update (∥ critic_update)
  → commit_iteration;
- a chunk, :func:`next_chunk` (inside a ``@dynamic``): up to ``run.iterations_per_chunk`` iterations
  (:func:`chain_iterations`), then the chunk again on the rest;
- a training run, :func:`train`: prepare_run → the chunks → finish_run, and beside the chunks
  :func:`run_services`: a resident run's services on a cluster (nodes that end when finish_run stops them).

Wiring only: every task is in ``tasks/``."""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

from flytekit import Resources, dynamic

from tasks.advantages import advantages
from models.config import TrainConfig
from models.run.types import PolicyState, RunHandle
from models.stages.outputs import ServiceSummary
from tasks.deploy import is_local_execution, resources_for, use_local_topology
from tasks import resident, secrets
from tasks.services import actor_service, critic_service, engine_service
from tasks.iteration import commit_iteration, evaluate, finish_run
from tasks.rollout import rollout
from tasks.run_tasks import prepare_run
from tasks.score import score, score_ranks
from tasks.updates import actor_update, critic_update


class Stages(NamedTuple):
    """The tasks of an iteration: the stateless ones (each loads its models), or a resident run's, which
    send requests to the run's services (``run.resident``; their resources are the services')."""

    rollout: object
    score: object
    actor_update: object
    critic_update: object
    evaluate: object
    resident: bool


STATELESS = Stages(rollout, score, actor_update, critic_update, evaluate, False)
RESIDENT = Stages(resident.rollout_resident, resident.score_resident, resident.actor_update_resident,
                  resident.critic_update_resident, resident.evaluate_resident, True)


def stages_for(known: Optional[TrainConfig]) -> Stages:
    return RESIDENT if known is not None and known.run.resident else STATELESS


def with_resources(node, known: Optional[TrainConfig], stages: Stages, role: str):
    """``node`` with the run's resources for ``role`` (a resident run's tasks keep their own: small)."""
    if known is not None and not stages.resident:
        node.with_overrides(**resources_for(known, role))
    return node


def wire_rollout(cfg, run, state, known: Optional[TrainConfig] = None, ahead: int = 0):
    """The rollout node of iteration ``state.iteration + ahead``, sampling from ``state``'s actor."""
    stages = stages_for(known)
    return with_resources(stages.rollout(cfg=cfg, run=run, state=state, ahead=ahead), known, stages, "rollout")


def wire_evaluate(cfg, run, state, known: TrainConfig):
    stages = stages_for(known)
    return with_resources(stages.evaluate(cfg=cfg, run=run, state=state), known, stages, "rollout")


def wire_iteration(cfg, run, state, critic: bool, known: Optional[TrainConfig] = None, sampled=None):
    """rollout → score → advantages → actor_update (∥ critic_update) → commit_iteration.

    ``known``: the concrete config inside a dynamic workflow; its ``resources`` (and, in local
    executions, the actor's and the critic's elastic launches) override the registered task settings. On
    a cluster the updates' topologies are the registered ones, checked by ``prepare_run`` before the run
    is created.
    ``sampled``: this iteration's rollout node when it was wired ahead (off-policy pipelining).
    """
    stages = stages_for(known)
    on_ranks = known is not None and not stages.resident and known.actor.score_on_ranks  # score as an elastic job
    if known is not None and is_local_execution() and not stages.resident:
        use_local_topology(actor_update, known)
        if on_ranks:
            use_local_topology(score_ranks, known)
        if critic:
            use_local_topology(critic_update, known, "critic")
    ro = sampled if sampled is not None else wire_rollout(cfg, run, state, known)
    score_task = score_ranks if on_ranks else stages.score
    sc = with_resources(score_task(cfg=cfg, run=run, state=state, batch=ro.batch), known, stages, "score")
    ad = advantages(cfg=cfg, run=run, state=state, batch=sc.batch)
    ac = with_resources(stages.actor_update(cfg=cfg, run=run, state=state, batch=ad.batch), known, stages, "actor")
    stats = [ro.stats, sc.stats, ad.stats, ac.stats]
    critic_url = ""
    if critic:
        cr = with_resources(stages.critic_update(cfg=cfg, run=run, state=state, batch=ad.batch), known, stages,
                            "critic")
        stats.append(cr.stats)
        critic_url = cr.checkpoint_url
    return commit_iteration(cfg=cfg, run=run, state=state, stats=stats, batch=sc.batch,
                            actor_url=ac.checkpoint_url, critic_url=critic_url)


def eval_due(cfg: TrainConfig, iteration: int) -> bool:
    """Whether the policy made by ``iteration`` is evaluated; -1 is the starting policy."""
    if iteration < 0:
        return cfg.run.eval_before_training
    last = iteration + 1 == cfg.run.num_iterations
    return cfg.run.eval_interval > 0 and ((iteration + 1) % cfg.run.eval_interval == 0 or last)


def chain_iterations(cfg: TrainConfig, run, state, critic: bool) -> Tuple[object, bool]:
    """Inside a dynamic workflow: up to ``run.iterations_per_chunk`` iterations from ``state``.

    Returns the last state and whether iterations remain (the caller recurses), so each
    sub-workflow stays far below Flyte's limit on nodes per workflow.
    """
    start = state.iteration
    stop = min(start + cfg.run.iterations_per_chunk, cfg.run.num_iterations)
    if eval_due(cfg, start - 1):  # the starting policy (step -1), or resumed after a crash between commit
        # and evaluate: a no-op when that evaluation is logged
        wire_evaluate(cfg, run, state, cfg)
    sampled = None
    if cfg.run.off_policy_steps:
        # The chunk's first batch: from the actor one update older than state's, as the pipeline sampled
        # it before a chunk boundary or a crash (lag 0 at the run's start).
        sampler, lead = state.sampler()
        sampled = wire_rollout(cfg, run, sampler, cfg, ahead=lead)
    for i in range(start, stop):
        # Off-policy: iteration i+1's batch samples from state i's actor beside iteration i's update.
        ahead = wire_rollout(cfg, run, state, cfg, ahead=1) if sampled is not None and i + 1 < stop else None
        state = wire_iteration(cfg, run, state, critic, known=cfg, sampled=sampled)
        sampled = ahead
        if eval_due(cfg, i):
            wire_evaluate(cfg, run, state, cfg)
    return state, stop < cfg.run.num_iterations


def next_chunk(chunk, cfg: TrainConfig, run, state, critic: bool):
    """The body of a training workflow's ``@dynamic`` chunk: up to ``run.iterations_per_chunk``
    iterations from ``state``, then ``chunk`` (the dynamic workflow itself) on the iterations left;
    the state after the last."""
    state, more = chain_iterations(cfg, run, state, critic)
    return chunk(cfg=cfg, run=run, state=state) if more else state


class Trained(NamedTuple):
    setup: object
    """``prepare_run``'s node: the run's config, handle and starting state."""
    summary: object
    """``finish_run``'s node: the run's :class:`~models.stages.finish.TrainingSummary`."""


@dynamic(requests=Resources(cpu="500m", mem="1Gi"), secret_requests=secrets.requests(secrets.S3))
def run_services(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> List[ServiceSummary]:
    """A resident run's services on a cluster (``tasks/services.py``), started from ``state`` beside the
    run's iterations, each with the run's resources; their summaries once ``finish_run`` stopped them.
    Nothing for a stateless run, nor in a local execution (``prepare_run`` starts the services there)."""
    if not cfg.run.resident or is_local_execution():
        return []
    nodes = [engine_service(cfg=cfg, run=run, state=state).with_overrides(**resources_for(cfg, "rollout")),
             actor_service(cfg=cfg, run=run, state=state).with_overrides(**resources_for(cfg, "actor"))]
    if cfg.uses_critic:
        nodes.append(critic_service(cfg=cfg, run=run, state=state).with_overrides(**resources_for(cfg, "critic")))
    return nodes


def train(chunk, workflow: str, preset: str, overrides: List[str], run_name: str) -> Trained:
    """The body of a training workflow: ``prepare_run`` (as ``workflow``: ``ppo`` or ``reinforce``),
    the run's iterations by ``chunk`` (its ``@dynamic``), ``finish_run``; beside the iterations, a resident
    run's services (:func:`run_services`: the workflow ends when they do, after ``finish_run`` stopped them)."""
    setup = prepare_run(preset=preset, overrides=overrides, run_name=run_name, workflow=workflow)
    run_services(cfg=setup.cfg, run=setup.run, state=setup.state)
    final = chunk(cfg=setup.cfg, run=setup.run, state=setup.state)
    return Trained(setup, finish_run(cfg=setup.cfg, run=setup.run, state=final))
