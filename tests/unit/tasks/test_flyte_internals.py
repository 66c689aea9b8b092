"""Each flytekit private or internal name ``tasks/flyte_internals.py`` relies on, checked against the
installed flytekit: an upgrade that renames, moves or reshapes one fails here, naming it. And no other
product module touches one."""

from __future__ import annotations

import ast
import inspect
import os
import pathlib
import sys

import pytest

from tasks import flyte_internals

ROOT = pathlib.Path(__file__).resolve().parents[3]


def train(x: int) -> int:
    return x + 1


def _elastic(**kwargs):
    from flytekitplugins.kfpytorch import Elastic

    return Elastic(nnodes=1, increase_shared_mem=False, **kwargs)


def test_a_tasks_config_is_what_with_overrides_assigns():
    """``Node.with_overrides(task_config=...)`` assigns ``run_entity._task_config``; ``task_config`` reads it."""
    from flytekit.core.node import Node

    assert "run_entity._task_config = task_config" in inspect.getsource(Node.with_overrides)
    task = flyte_internals.PytorchElasticFunctionTask(task_config=_elastic(nproc_per_node=2), task_function=train)
    other = _elastic(nproc_per_node=1)
    flyte_internals.set_task_config(task, other)
    assert task.task_config is other
    assert task.task_function(x=1) == 2  # the public name of the function the plugin pickles for its workers


def test_pyflytes_error_printer_is_a_module_global_its_command_looks_up():
    import flytekit.clis.sdk_in_container.utils as cli

    assert cli.__name__ == flyte_internals.CLI_MODULE
    params = inspect.signature(cli.pretty_print_exception).parameters
    assert list(params) == ["e", "verbosity"] and params["verbosity"].default == 1
    invoke = cli.ErrorHandlingCommand.invoke
    assert invoke.__globals__ is vars(cli) and "pretty_print_exception" in invoke.__code__.co_names


def test_the_printer_is_replaced_once_and_only_inside_pyflyte(monkeypatch):
    import flytekit.clis.sdk_in_container.utils as cli

    monkeypatch.setattr(cli, "pretty_print_exception", cli.pretty_print_exception)  # restored afterwards
    original = cli.pretty_print_exception
    wrapped = []

    def wrap(fn):
        wrapped.append(fn)
        return lambda e, verbosity=1: fn(e, verbosity)

    assert flyte_internals.replace_cli_error_printer(wrap) and wrapped == [original]
    assert not flyte_internals.replace_cli_error_printer(wrap) and len(wrapped) == 1  # not wrapped twice
    monkeypatch.delitem(sys.modules, flyte_internals.CLI_MODULE)
    assert not flyte_internals.replace_cli_error_printer(wrap)  # not inside pyflyte: nothing to do


def test_flytekits_wrappers_hold_the_users_exception_as_value():
    from flytekit.exceptions.scopes import FlyteScopedUserException
    from flytekit.exceptions.user import FlyteUserRuntimeException

    err = ValueError("bad value")
    assert flyte_internals.wrapped_error(FlyteScopedUserException(ValueError, err, None)) is err
    assert flyte_internals.wrapped_error(FlyteUserRuntimeException(err)) is err
    assert flyte_internals.wrapped_error(err) is None


def test_the_elastic_plugins_launch_has_the_shape_tasks_elastic_replaces():
    cls = flyte_internals.PytorchElasticFunctionTask
    assert "_execute" in cls.execute.__code__.co_names  # execute() delegates to the method overridden
    body = inspect.getsource(cls._execute)
    assert all(f'start_method == "{m}"' in body for m in flyte_internals.PLUGIN_START_METHODS)
    assert list(inspect.signature(flyte_internals.spawn_helper).parameters) == [
        "fn", "raw_output_prefix", "checkpoint_dest", "checkpoint_src", "kwargs"]
    assert len(inspect.signature(flyte_internals.is_recoverable_worker_error).parameters) == 1
    assert flyte_internals.ElasticWorkerResult._fields == ("return_value", "decks", "om")
    for name in ("min_nodes", "max_nodes", "rdzv_backend"):
        assert f"self.{name}" in inspect.getsource(cls.__init__), name


def test_a_start_method_the_plugin_lacks_goes_to_launch():
    class Launched(flyte_internals.CustomLaunchElasticTask):
        def launch(self, kwargs):
            return ("launched", kwargs)

    task = Launched(task_config=_elastic(nproc_per_node=1, start_method="forkserver"), task_function=train)
    assert task.execute(x=3) == ("launched", {"x": 3})
    with pytest.raises(NotImplementedError, match="forkserver"):  # the base class launches nothing itself
        flyte_internals.CustomLaunchElasticTask(task_config=task.task_config, task_function=train).execute(x=3)


def test_rank0s_result_is_handed_over_as_the_plugin_does():
    """Its decks (but the timeline) join this process's, its output metadata this context's tracker."""
    import flytekit
    from flytekit.core.context_manager import FlyteContextManager, OutputMetadata, OutputMetadataTracker

    tracker = OutputMetadataTracker()
    ctx = FlyteContextManager.current_context().new_builder().with_output_metadata_tracker(tracker).build()
    with FlyteContextManager.with_context(ctx.new_builder()):
        deck, timeline = flytekit.Deck("rank0"), flytekit.deck.deck.TimeLineDeck("timeline")
        flytekit.current_context().decks.clear()  # a new deck registers itself here: start without them
        value, om = [7], OutputMetadata(artifact=None, dynamic_partitions=None)
        result = flyte_internals.ElasticWorkerResult(return_value=value, decks=[deck, timeline], om=om)
        assert flyte_internals.adopt_rank0_result(result) is value
        assert flytekit.current_context().decks == [deck]
        assert tracker.get(value) is om


def test_dataclass_types_are_computed_once_and_equal_flytekits_own():
    """Every task module imported (``tasks/__init__.py`` installs the cache first): the config's Flyte type
    from the cache is the one flytekit computes uncached (schema, field structure, annotation), and a
    second interface naming it gets the same object without flytekit computing it again."""
    import dataclasses

    from flytekit.core.type_engine import DataclassTransformer, TypeEngine

    import workflows.ppo  # noqa: F401  (every task and workflow defined: the cache in use)
    from models.config import TrainConfig
    from models.run.types import PolicyState

    cached = DataclassTransformer.get_literal_type
    assert cached._flyte_rlhf and not flyte_internals.cache_dataclass_literal_types()  # installed once
    for t in (TrainConfig, PolicyState):
        got = TypeEngine.to_literal_type(t)
        want = cached.uncached(DataclassTransformer(), t)
        assert got is not want and got.to_flyte_idl() == want.to_flyte_idl()
        assert got.metadata["title"] == t.__name__ and set(got.structure.dataclass_type) == \
            {f.name for f in dataclasses.fields(t)}
        assert TypeEngine.to_literal_type(t) is got  # the second interface: no new computation

    @dataclasses.dataclass
    class Fresh:
        x: int = 1

    first = TypeEngine.to_literal_type(Fresh)  # a dataclass no task names: cached on first use
    assert TypeEngine.to_literal_type(Fresh) is first and set(first.structure.dataclass_type) == {"x"}


def _refused():
    raise AssertionError("computed again: the machine's cache was not read")


def test_dataclass_types_are_kept_per_machine_by_what_they_are_made_of(tmp_path, monkeypatch):
    """Another process reads a dataclass's Flyte type from the machine's cache (equal to flytekit's own); the key
    moves with a field's default, with a nested dataclass's field, and not with the object; a cached file that
    names a class other than flytekit's models is computed again, not loaded."""
    import dataclasses
    import pickle

    from flytekit.core.type_engine import DataclassTransformer

    from models.config import TrainConfig

    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    uncached = DataclassTransformer.get_literal_type.uncached
    want = uncached(DataclassTransformer(), TrainConfig)
    got = flyte_internals._machine_cached_literal_type(TrainConfig,
                                                       lambda: uncached(DataclassTransformer(), TrainConfig))
    again = flyte_internals._machine_cached_literal_type(TrainConfig, _refused)  # another process: read back
    assert got.to_flyte_idl() == want.to_flyte_idl() == again.to_flyte_idl()
    assert again.metadata == want.metadata  # the JSON schema as flytekit built it (integers stay integers)

    def inner(limit: int):
        return dataclasses.make_dataclass("Inner", [("limit", int, dataclasses.field(default=limit))])

    def outer(nested, default: float = 0.5):
        return dataclasses.make_dataclass("Outer", [("rate", float, dataclasses.field(default=default)),
                                                    ("inner", nested, dataclasses.field(default_factory=nested))])

    key = flyte_internals.dataclass_type_key
    assert key(outer(inner(1))) == key(outer(inner(1))) and key(TrainConfig) == key(TrainConfig)
    assert len({key(outer(inner(1))), key(outer(inner(2))), key(outer(inner(1), 0.25))}) == 3
    assert key(int) is None
    required = dataclasses.make_dataclass("Required", [("x", int)])  # no default: a key all the same, which
    assert key(required) is not None  # another process finds (no object's address in it)
    assert key(dataclasses.make_dataclass("Odd", [("o", object, dataclasses.field(default_factory=object))])) is None

    for f in (tmp_path / "cache" / "python").glob("flyte_dataclass_type-*"):
        f.write_bytes(pickle.dumps(tmp_path))  # a pathlib class: refused, computed again
    with pytest.raises(AssertionError, match="computed again"):
        flyte_internals._machine_cached_literal_type(TrainConfig, _refused)


def test_each_task_is_noted_as_it_starts(monkeypatch):
    """A local execution's tasks pass through ``PythonTask.dispatch_execute`` (``tasks/__init__.py`` wraps it once):
    each one's name reaches the run's keeper, the dynamic's and the task's inside it."""
    from flytekit import dynamic, task

    from models.run import keeper

    noted = []

    class Keeper:  # this process's keeper, as far as note_task sees it
        say = noted.append

    monkeypatch.setitem(keeper._started, os.getpid(), Keeper())
    assert not flyte_internals.note_each_task(keeper.note_task)  # installed once already

    @task
    def inner(x: int) -> int:
        return x + 1

    @dynamic
    def outer(x: int) -> int:
        return inner(x=x)

    assert outer(x=1) == 2
    assert [n.rsplit(".", 1)[-1] for n in noted] == ["outer", "inner"] and noted[0].startswith("task "), noted


PRIVATE_FLYTE = ("_task_config", "_task_function", "_execute", "pretty_print_exception", "output_metadata_tracker",
                 "TimeLineDeck", "spawn_helper", "is_recoverable_worker_error", "sdk_in_container")


@pytest.mark.parametrize("folder", ["tasks", "workflows", "models"])
def test_no_other_product_module_touches_them(folder):
    """The names above appear only in tasks/flyte_internals.py (attributes, imports but from it, string
    look-ups)."""
    touches = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if path.name == "flyte_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.attr] if isinstance(node, ast.Attribute) else
                     [a.name for a in node.names] if isinstance(node, ast.ImportFrom)
                     and node.module != "tasks.flyte_internals" else
                     [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else [])
            touches += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                        if any(p == n or (p == "sdk_in_container" and p in n) for p in PRIVATE_FLYTE)]
    assert not touches, touches
