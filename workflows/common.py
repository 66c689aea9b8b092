"""The training workflows, defined once: PPO (``workflows/ppo.py``) and the critic-free algorithms
(``workflows/reinforce.py``) differ only by whether a critic runs, so each module binds the same definitions
under its own names (Flyte names a workflow after the module attribute that holds it):

- one iteration, :func:`wire_iteration`: rollout → score → advantages → actor_update (∥ critic_update)
  → commit_iteration;
- a chunk, :func:`chain_iterations` (inside a ``@dynamic``): up to ``run.iterations_per_chunk`` iterations;
- one execution's share of the run, :func:`run_execution` (inside a ``@dynamic``): up to
  ``run.iterations_per_execution`` iterations as chunks one after another, then the next execution of the
  run, launched from the state they reached (a launch-plan node: Flyte runs it as an execution with its own
  record). So no execution's record grows with the run's length and nesting stays three levels deep
  (docs/cluster.md#long-runs);
- a training run, :func:`train`: prepare_run → the run's first execution of iterations → finish_run, and
  beside the iterations :func:`run_services`: a resident run's services on a cluster (nodes that end when
  finish_run stops them, so they outlive every execution of iterations).

Every task that renews the run's lock or calls its services gets ``launch``, the lock's holder
(``prepare_run``'s, :attr:`models.run.types.RunHandle.launch`), whichever execution of the chain it runs in.

Wiring only: every task is in ``tasks/``."""

from __future__ import annotations

from typing import List, NamedTuple, Optional

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


def launched(stages: Stages, launch: str, renews_lock: bool = True) -> dict:
    """The ``launch`` argument of a task of ``stages`` that takes one: every resident task (it calls a service),
    and the stateless tasks that renew the run's lock (the updates and the evaluation, not rollout and score)."""
    return {"launch": launch} if stages.resident or renews_lock else {}


def wire_rollout(cfg, run, state, known: Optional[TrainConfig] = None, ahead: int = 0, launch: str = ""):
    """The rollout node of iteration ``state.iteration + ahead``, sampling from ``state``'s actor."""
    stages = stages_for(known)
    return with_resources(stages.rollout(cfg=cfg, run=run, state=state, ahead=ahead,
                                         **launched(stages, launch, renews_lock=False)), known, stages, "rollout")


def wire_evaluate(cfg, run, state, known: TrainConfig, launch: str = ""):
    stages = stages_for(known)
    return with_resources(stages.evaluate(cfg=cfg, run=run, state=state, **launched(stages, launch)), known, stages,
                          "rollout")


def wire_iteration(cfg, run, state, critic: bool, known: Optional[TrainConfig] = None, sampled=None,
                   launch: str = ""):
    """rollout → score → advantages → actor_update (∥ critic_update) → commit_iteration.

    ``known``: the concrete config inside a dynamic workflow; its ``resources`` (and, in local
    executions, the actor's and the critic's elastic launches) override the registered task settings. On
    a cluster the updates' topologies are the registered ones, checked by ``prepare_run`` before the run
    is created.
    ``sampled``: this iteration's rollout node when it was wired ahead (off-policy pipelining).
    ``launch``: the holder of the run's lock (``prepare_run``'s).
    """
    stages = stages_for(known)
    held = launched(stages, launch)
    on_ranks = known is not None and not stages.resident and known.actor.score_on_ranks  # score as an elastic job
    if known is not None and is_local_execution() and not stages.resident:
        use_local_topology(actor_update, known)
        if on_ranks:
            use_local_topology(score_ranks, known)
        if critic:
            use_local_topology(critic_update, known, "critic")
    ro = sampled if sampled is not None else wire_rollout(cfg, run, state, known, launch=launch)
    score_task = score_ranks if on_ranks else stages.score
    sc = with_resources(score_task(cfg=cfg, run=run, state=state, batch=ro.batch,
                                   **launched(stages, launch, renews_lock=False)), known, stages, "score")
    ad = advantages(cfg=cfg, run=run, state=state, batch=sc.batch)
    ac = with_resources(stages.actor_update(cfg=cfg, run=run, state=state, batch=ad.batch, **held), known, stages,
                        "actor")
    stats = [ro.stats, sc.stats, ad.stats, ac.stats]
    critic_url = ""
    if critic:
        cr = with_resources(stages.critic_update(cfg=cfg, run=run, state=state, batch=ad.batch, **held), known,
                            stages, "critic")
        stats.append(cr.stats)
        critic_url = cr.checkpoint_url
    return commit_iteration(cfg=cfg, run=run, state=state, stats=stats, batch=sc.batch,
                            actor_url=ac.checkpoint_url, critic_url=critic_url, launch=launch)


def eval_due(cfg: TrainConfig, iteration: int) -> bool:
    """Whether the policy made by ``iteration`` is evaluated; -1 is the starting policy."""
    if iteration < 0:
        return cfg.run.eval_before_training
    last = iteration + 1 == cfg.run.num_iterations
    return cfg.run.eval_interval > 0 and ((iteration + 1) % cfg.run.eval_interval == 0 or last)


def chain_iterations(cfg: TrainConfig, run, state, critic: bool, stop: int, launch: str = ""):
    """Inside a dynamic workflow (a chunk): iterations ``state.iteration`` … ``stop - 1``, each evaluated when
    due; the state after the last. Off-policy, the chunk's first batch is sampled here and each next one beside
    the update before it."""
    sampled = None
    if cfg.run.pipelined:
        # The chunk's first batch: from the actor one update older than state's, as the pipeline sampled
        # it before a chunk boundary or a crash (lag 0 at the run's start).
        sampler, lead = state.sampler()
        sampled = wire_rollout(cfg, run, sampler, cfg, ahead=lead, launch=launch)
    for i in range(state.iteration, stop):
        # Off-policy: iteration i+1's batch samples from state i's actor beside iteration i's update.
        ahead = wire_rollout(cfg, run, state, cfg, ahead=1, launch=launch) \
            if sampled is not None and i + 1 < stop else None
        state = wire_iteration(cfg, run, state, critic, known=cfg, sampled=sampled, launch=launch)
        sampled = ahead
        if eval_due(cfg, i):
            wire_evaluate(cfg, run, state, cfg, launch=launch)
    return state


def execution_end(cfg: TrainConfig, start: int) -> int:
    """Where the execution of iterations that starts at ``start`` stops: after ``run.iterations_per_execution``
    iterations, or at the run's end. A local run is one execution (nothing of it is recorded by a control
    plane, and nested launches would only deepen the ``pyflyte`` process's stack)."""
    if is_local_execution():
        return cfg.run.num_iterations
    return min(start + cfg.run.iterations_per_execution, cfg.run.num_iterations)


def run_execution(chunk, successor, cfg: TrainConfig, run, state, launch: str):
    """The body of a training workflow's ``@dynamic`` of one execution: the starting policy's evaluation when
    due (step -1, or a resumed run's lost one: a no-op when it is logged), up to ``run.iterations_per_execution``
    iterations from ``state`` as ``chunk`` nodes of ``run.iterations_per_chunk`` one after another, then
    ``successor`` (the launch plan of this execution's workflow) on the iterations left: a new execution."""
    start = state.iteration
    end = execution_end(cfg, start)
    if eval_due(cfg, start - 1):
        wire_evaluate(cfg, run, state, cfg, launch=launch)
    for first in range(start, end, cfg.run.iterations_per_chunk):
        state = chunk(cfg=cfg, run=run, state=state, stop=min(first + cfg.run.iterations_per_chunk, end),
                      launch=launch)
    if end < cfg.run.num_iterations:
        return successor(cfg=cfg, run=run, state=state, launch=launch)
    return state


class Trained(NamedTuple):
    setup: object
    """``prepare_run``'s node: the run's config, handle, starting state and launch."""
    summary: object
    """``finish_run``'s node: the run's :class:`~models.stages.outputs.TrainingSummary`."""


@dynamic(requests=Resources(cpu="500m", mem="1Gi"), secret_requests=secrets.requests(secrets.S3))
def run_services(cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str) -> List[ServiceSummary]:
    """A resident run's services on a cluster (``tasks/services.py``), started from ``state`` beside the
    run's iterations, each with the run's resources; their summaries once ``finish_run`` stopped them.
    They belong to the run's first execution, which lasts until the run ends, so every later execution of the
    run's iterations calls the same services (found under the run folder, published by ``launch``).
    Nothing for a stateless run, nor in a local execution (``prepare_run`` starts the services there)."""
    if not cfg.run.resident or is_local_execution():
        return []
    args = dict(cfg=cfg, run=run, state=state, launch=launch)
    nodes = [] if cfg.run.resident_layout == "colocated" else [  # colocated: the actor's ranks hold the engines
        engine_service(**args).with_overrides(**resources_for(cfg, "rollout"))]
    nodes.append(actor_service(**args).with_overrides(**resources_for(cfg, "actor")))
    if cfg.uses_critic:
        nodes.append(critic_service(**args).with_overrides(**resources_for(cfg, "critic")))
    return nodes


def train(execution, workflow: str, preset: str, overrides: List[str], run_name: str) -> Trained:
    """The body of a training workflow: ``prepare_run`` (as ``workflow``: ``ppo`` or ``reinforce``), the run's
    iterations by ``execution`` (the launch plan of its executions of iterations, each launching the next),
    ``finish_run``; beside the iterations, a resident run's services (:func:`run_services`: the workflow ends
    when they do, after ``finish_run`` stopped them)."""
    setup = prepare_run(preset=preset, overrides=overrides, run_name=run_name, workflow=workflow)
    run_services(cfg=setup.cfg, run=setup.run, state=setup.state, launch=setup.launch)
    final = execution(cfg=setup.cfg, run=setup.run, state=setup.state, launch=setup.launch)
    return Trained(setup, finish_run(cfg=setup.cfg, run=setup.run, state=final, launch=setup.launch))
