"""A long run on a cluster is a chain of executions, none of whose records grows with the run (issue #36,
docs/cluster.md#long-runs): the dynamic workflows of a 2,000-iteration run of the 8B PPO preset compiled as a
task pod compiles them (``dispatch_execute`` in a cluster's execution context), walked execution by execution,
with no training."""

from __future__ import annotations

import tempfile

import pytest

from models.config.io import load_config
from models.run.types import PolicyState, RunHandle

ITERATIONS = 2000
RUN = RunHandle("s3://b/runs", "r", "0" * 32, "s3://b/runs/r/reference", "s3://b/runs/r/data/train_prompts.jsonl",
                "s3://b/runs/r/data/eval_prompts.jsonl")
LAUNCH = "flyte:p/development/root"
PER_NODE_BYTES = 55
"""A node's status in propeller's workflow object: about 440 bytes per iteration of 8 nodes (issue #36's estimate
from flytepropeller's ``NodeStatus`` structs)."""
MAX_DOWNLOAD_BYTES = 2 * 2 ** 20
"""``storage.limits.maxDownloadMBs``' default: the largest ``futures.pb`` propeller reads."""
RECORD_LIMIT = 1.5 * 2 ** 20
"""etcd's default request size, past which propeller aborts an execution ("Workflow size has breached threshold")."""


def compile_dynamic(task, **values):
    """The ``DynamicJobSpec`` (``futures.pb``) ``task``'s pod writes for ``values`` in a cluster execution (a
    fresh task of the same function each time: flytekit compiles a dynamic workflow once per task object)."""
    from flytekit import FlyteContextManager, dynamic
    from flytekit.configuration import Image, ImageConfig, SerializationSettings
    from flytekit.core.context_manager import ExecutionParameters, ExecutionState
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models import literals
    from flytekit.models.core.identifier import WorkflowExecutionIdentifier

    task = dynamic(task.task_function)
    ctx = FlyteContextManager.current_context()
    types = task.python_interface.inputs
    inputs = literals.LiteralMap(literals={k: TypeEngine.to_literal(ctx, v, types[k], TypeEngine.to_literal_type(types[k]))
                                           for k, v in values.items()})
    params = ExecutionParameters.new_builder(ctx.user_space_params)
    params.execution_id = WorkflowExecutionIdentifier("p", "development", "e1")  # not "local": a cluster's pod
    state = ExecutionState(working_dir=tempfile.mkdtemp(), mode=ExecutionState.Mode.TASK_EXECUTION,
                           user_space_params=params.build())
    settings = SerializationSettings(ImageConfig(default_image=Image(name="default", fqn="img", tag="1")),
                                     project="p", domain="development", version="v1")
    with FlyteContextManager.with_context(ctx.with_serialization_settings(settings).with_execution_state(state)) as c:
        return task.dispatch_execute(c, inputs)


def targets(spec) -> list:
    """What each node of a compiled spec runs: a task's name, or ``("launch plan", name)``."""
    return [n.task_node.reference_id.name if n.task_node else ("launch plan", n.workflow_node.launchplan_ref.name)
            for n in spec.nodes]


@pytest.mark.slow  # 12 dynamic workflows compiled
def test_a_2000_iteration_run_is_a_chain_of_bounded_shallow_executions():
    from workflows.ppo import ppo_chunk, ppo_iterations, ppo_training

    cfg = load_config("llama8b_ppo_gpu", [f"run.num_iterations={ITERATIONS}"])
    per_execution, per_chunk = cfg.run.iterations_per_execution, cfg.run.iterations_per_chunk
    # The run's own execution: set-up, the services, the first execution of iterations, the finish.
    assert sorted(n.flyte_entity.name for n in ppo_training.nodes) == [
        "tasks.iteration.finish_run", "tasks.run_tasks.prepare_run", "workflows.common.run_services",
        "workflows.ppo.ppo_execution"]
    start, executions, records = 0, 0, []
    while start < ITERATIONS:
        state = PolicyState(start, f"s3://b/runs/r/iter-{start - 1:06d}/actor" if start else RUN.reference_url,
                            "s3://b/runs/r/critic-init", 0.01)
        spec = compile_dynamic(ppo_iterations, cfg=cfg, run=RUN, state=state, launch=LAUNCH)
        kinds = targets(spec)
        chunks = [n for n, k in zip(spec.nodes, kinds) if k == "workflows.ppo.ppo_chunk"]
        stops = [next(b.binding.scalar.primitive.integer for b in n.inputs if b.var == "stop") for n in chunks]
        end = stops[-1]
        assert [b - a for a, b in zip([start] + stops[:-1], stops)] == [per_chunk] * len(stops)  # one after another
        assert end - start == min(per_execution, ITERATIONS - start)  # at most iterations_per_execution
        plans = [k for k in kinds if isinstance(k, tuple)]
        assert plans == ([("launch plan", "workflows.ppo.ppo_execution")] if end < ITERATIONS else [])
        assert set(kinds) - {"workflows.ppo.ppo_chunk", "tasks.iteration.evaluate"} - set(plans) == set()
        if start == 0:  # the execution's own nodes, each chunk's (as many as the first's, counted below)
            records.append((len(spec.nodes) + 1, len(chunks)))
            futures = spec.to_flyte_idl().ByteSize()
            assert futures < MAX_DOWNLOAD_BYTES / 10  # what propeller reads back: 104 KB for 10 chunks
        executions += 1
        start = end
    assert executions == -(-ITERATIONS // per_execution)
    # A chunk holds tasks only: nesting is the execution's workflow, its dynamic and a chunk, whatever the run's
    # length. The run's first chunk and its last (the final evaluation):
    sizes = []
    for first, stop in ((0, per_chunk), (ITERATIONS - per_chunk, ITERATIONS)):
        chunk = compile_dynamic(ppo_chunk, cfg=cfg, run=RUN, state=PolicyState(first, RUN.reference_url), stop=stop,
                                launch=LAUNCH)
        names = targets(chunk)
        assert all(isinstance(k, str) and k.startswith("tasks.") for k in names), names
        assert names.count("tasks.iteration.commit_iteration") == stop - first
        sizes.append(len(chunk.nodes))
    own, chunks = records[0]
    record = own + chunks * max(sizes)
    print(f"{ITERATIONS} iterations: {executions} executions of {per_execution}; the first's record holds about "
          f"{record} nodes, ~{record * PER_NODE_BYTES / 1e3:.0f} KB of propeller's object; its futures.pb {futures} B")
    assert record * PER_NODE_BYTES < RECORD_LIMIT / 10  # ten times under etcd's limit


@pytest.mark.parametrize("overrides, message", [
    (["run.iterations_per_execution=0"], "run.iterations_per_execution must be 1 to 1000"),
    (["run.iterations_per_execution=5000"], "run.iterations_per_execution must be 1 to 1000"),
    (["run.iterations_per_execution=1000", "run.iterations_per_chunk=2"], "is 500 chunks per execution, over 250"),
])
def test_an_execution_too_large_for_the_control_plane_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config("configs/tiny_grpo.yaml", overrides)
