"""PPO's and the critic-free workflows are one definition (``workflows/common.py``) bound twice: compiled,
they hold the same nodes but for the critic's update and their own executions of iterations, and take the same
inputs."""

from __future__ import annotations


def node_entities(wf) -> list:
    """The names of what ``wf``'s nodes run (tasks, sub-workflows), sorted."""
    return sorted(n.flyte_entity.name for n in wf.nodes)


def test_one_iteration_differs_only_by_the_critic_update():
    from workflows.ppo import ppo_iteration
    from workflows.reinforce import reinforce_iteration

    ppo, critic_free = node_entities(ppo_iteration), node_entities(reinforce_iteration)
    assert "tasks.updates.critic_update" not in critic_free
    assert ppo == sorted(critic_free + ["tasks.updates.critic_update"])
    assert "tasks.updates.actor_update" in critic_free and "tasks.iteration.commit_iteration" in critic_free


def test_training_differs_only_by_its_executions():
    from workflows.ppo import ppo_training
    from workflows.reinforce import reinforce_training

    ppo, critic_free = node_entities(ppo_training), node_entities(reinforce_training)
    assert ppo == ["tasks.iteration.finish_run", "tasks.run_tasks.prepare_run", "workflows.common.run_services",
                   "workflows.ppo.ppo_execution"]  # the launch plan: the iterations run in executions of their own
    assert critic_free == [n.replace("ppo.ppo_execution", "reinforce.reinforce_execution") for n in ppo]
    assert ppo_training.python_interface.inputs == reinforce_training.python_interface.inputs
    assert ppo_training.python_interface.outputs == reinforce_training.python_interface.outputs


def test_a_colocated_run_has_no_engine_node_on_a_cluster():
    """A resident run's services as a cluster's pod compiles them (``run_services``' dynamic workflow): the engine,
    the actor and the critic in the separate layout, no engine node colocated (the actor's ranks hold the engines)."""
    from models.config.io import load_config
    from models.run.types import PolicyState
    from tests.unit.tasks.test_long_runs import LAUNCH, RUN, compile_dynamic, targets
    from workflows.common import run_services

    nodes = {}
    for layout in ("separate", "colocated"):
        cfg = load_config("llama8b_ppo_gpu", ["run.resident=true", f"run.resident_layout={layout}"])
        spec = compile_dynamic(run_services, cfg=cfg, run=RUN, state=PolicyState(0, RUN.reference_url), launch=LAUNCH)
        nodes[layout] = sorted(targets(spec))
    assert nodes["separate"] == ["tasks.services.actor_service", "tasks.services.critic_service",
                                 "tasks.services.engine_service"]
    assert nodes["colocated"] == ["tasks.services.actor_service", "tasks.services.critic_service"]
