"""Every use of flytekit's private or internal names, in one place.

flytekit promises nothing about these; ``tests/unit/tasks/test_flyte_internals.py`` checks each one
against the installed flytekit (the version ``constraints.txt`` pins), so an upgrade that moves one fails
there, naming it, instead of in a run.

- a task's ``_task_config``: the run's actor launch, set before a local execution calls the task (what
  ``Node.with_overrides(task_config=...)`` assigns); ``tasks/deploy.py``;
- ``flytekit.clis.sdk_in_container.utils.pretty_print_exception``: ``pyflyte``'s printer of a failed
  command's exception; ``tasks/cli_errors.py``;
- ``.value`` of ``FlyteScopedException`` and ``FlyteUserRuntimeException``: the user's exception inside
  flytekit's wrappers; ``tasks/cli_errors.py``;
- kfpytorch's ``PytorchElasticFunctionTask._execute``, ``spawn_helper``, ``is_recoverable_worker_error``
  and ``ElasticWorkerResult``: a launch of the elastic workers the plugin does not offer (a forkserver);
  ``tasks/elastic.py``;
- ``FlyteContextManager.current_context().output_metadata_tracker`` and ``flytekit.deck.deck.TimeLineDeck``:
  rank 0's decks and output metadata handed to the task's process, as the plugin does; ``tasks/elastic.py``;
- ``DataclassTransformer.get_literal_type``: computed once per dataclass per process, and kept in the machine's
  cache across processes (:func:`cache_dataclass_literal_types`, installed by ``tasks/__init__.py``);
- ``PythonTask.dispatch_execute``: each task's name told to the run's keeper as it starts (:func:`note_each_task`,
  installed by ``tasks/__init__.py``), so a ``pyflyte`` process killed mid-task is named with its task.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Dict, Optional

import flytekit
from flytekit.core.context_manager import FlyteContextManager
from flytekitplugins.kfpytorch.task import (  # noqa: F401  (re-exported for tasks/elastic.py)
    ElasticWorkerResult,
    PytorchElasticFunctionTask,
    is_recoverable_worker_error,
    spawn_helper,
)

CLI_MODULE = "flytekit.clis.sdk_in_container.utils"
"""The module of ``pyflyte``'s ``ErrorHandlingCommand``, whose ``invoke`` prints a failed command's
exception with this module's ``pretty_print_exception(e, verbosity)``."""

PLUGIN_START_METHODS = ("spawn", "fork")
"""The ``Elastic.start_method`` values the plugin's ``_execute`` launches itself."""


def set_task_config(task, task_config) -> None:
    """Give ``task`` another config of the same type, as ``Node.with_overrides(task_config=...)`` does
    (``flytekit.core.node``); the task's ``task_config`` then returns it."""
    task._task_config = task_config


def replace_cli_error_printer(wrap: Callable[[Callable], Callable]) -> bool:
    """Inside ``pyflyte`` (its CLI module loaded): replace ``pretty_print_exception(e, verbosity=1)`` by
    ``wrap(original)``, once per process. Elsewhere (task pods, elastic workers, tests) nothing changes:
    False."""
    cli = sys.modules.get(CLI_MODULE)
    original = getattr(cli, "pretty_print_exception", None)
    if original is None or getattr(original, "_flyte_rlhf", False):
        return False
    replacement = wrap(original)
    replacement._flyte_rlhf = True
    cli.pretty_print_exception = replacement
    return True


def cache_dataclass_literal_types() -> bool:
    """Make flytekit's ``DataclassTransformer.get_literal_type`` compute each dataclass's Flyte type once
    per process, and once per machine. flytekit 1.16 rebuilds it for every task interface that names the dataclass,
    and for every nested dataclass again inside it, each time building a JSON schema with mashumaro (which
    compiles a serialiser class for every field default), ``TrainConfig`` being in every task's interface:
    importing the workflows (``pyflyte run``, a chunk's pod, ``pyflyte package``) took 12.2 s, 7.2 s with
    the per-process memo on the 2-core box (benchmarks/RESULTS.md, 2026-11-26), and the first computation still
    cost about 1 s of CPU in every process that imports a task module (each pod). The type depends only on the class
    (its fields, their types and defaults, nested dataclasses the same way) and the installed flytekit and mashumaro,
    so it is also read from a file of the machine's cache (:func:`dataclass_type_key`), and flytekit never changes a
    returned one, so the same object is returned in a process. Unhashable arguments, and classes whose fields cannot
    be read, are passed through. Installed once: False after."""
    from flytekit.core.type_engine import DataclassTransformer

    original = DataclassTransformer.get_literal_type
    if getattr(original, "_flyte_rlhf", False):
        return False
    memo: Dict[Any, Any] = {}

    @functools.wraps(original)
    def get_literal_type(self, t):
        try:
            return memo[t]
        except KeyError:
            memo[t] = found = _machine_cached_literal_type(t, lambda: original(self, t))
            return found
        except TypeError:  # an unhashable annotation: computed each time, as before
            return original(self, t)

    get_literal_type._flyte_rlhf = True
    get_literal_type.uncached = original
    DataclassTransformer.get_literal_type = get_literal_type
    return True


def dataclass_type_key(t: Any) -> Optional[str]:
    """A digest of what a dataclass's Flyte type is made of: each field's name, type, default (a factory's product)
    and metadata, the class's bases and mashumaro ``Config``, the same of every dataclass named in a field's type,
    and the installed distributions (flytekit's and mashumaro's versions among them). None when ``t`` is no
    dataclass, a field cannot be read, or a part shows only an object's address (no key another process finds)."""
    import dataclasses
    import hashlib
    import typing

    from models.library_imports import distributions_digest

    parts: list = [distributions_digest()]
    todo, seen = [t], set()
    try:
        while todo:
            cls = todo.pop()
            if cls in seen:
                continue
            seen.add(cls)
            if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
                return None
            hints = typing.get_type_hints(cls)
            config = getattr(cls, "Config", None)  # mashumaro's per-class options (aliases, strategies), if any
            parts.append((cls.__module__, cls.__qualname__, [b.__qualname__ for b in cls.__mro__],
                          repr({k: v for k, v in vars(config).items() if not k.startswith("__")}) if config else ""))
            for f in dataclasses.fields(cls):
                default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                kind = hints.get(f.name, f.type)
                parts.append((f.name, repr(kind), "MISSING" if default is dataclasses.MISSING else repr(default),
                              repr(dict(f.metadata))))
                stack = [kind]
                while stack:
                    arg = stack.pop()
                    stack.extend(typing.get_args(arg))
                    if dataclasses.is_dataclass(arg) and isinstance(arg, type):
                        todo.append(arg)
    except Exception:  # noqa: BLE001 -- a type flytekit may still handle: computed, not cached
        return None
    text = repr(parts)
    if " at 0x" in text:  # an object without a repr of its own (a default, a metadata value): no stable key
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _machine_cached_literal_type(t: Any, compute: Callable[[], Any]) -> Any:
    """``compute()`` of ``t``'s Flyte type, from the machine's cache when ``t`` has a key (a pickle that may name
    flytekit's model classes only)."""
    from models.library_imports import pickle_cached

    key = dataclass_type_key(t)
    return compute() if key is None else pickle_cached(f"flyte_dataclass_type-{key}.pickle", compute,
                                                       ("flytekit.models.",))


def note_each_task(note: Callable[[str], None]) -> bool:
    """Call ``note(task name)`` as each task starts in this process (``PythonTask.dispatch_execute``, which a local
    execution calls for every task, and a pod's entrypoint for its own); once per process: False after."""
    from flytekit.core.base_task import PythonTask

    original = PythonTask.dispatch_execute
    if getattr(original, "_flyte_rlhf", False):
        return False

    @functools.wraps(original)
    def dispatch_execute(self, ctx, input_literal_map):
        note(self.name)
        return original(self, ctx, input_literal_map)

    dispatch_execute._flyte_rlhf = True
    PythonTask.dispatch_execute = dispatch_execute
    return True


def wrapped_error(err: BaseException) -> Optional[BaseException]:
    """The exception flytekit wrapped in ``err`` (``FlyteScopedException.value``,
    ``FlyteUserRuntimeException.value``), or None."""
    value = getattr(err, "value", None)
    return value if isinstance(value, BaseException) else None


class CustomLaunchElasticTask(PytorchElasticFunctionTask):
    """The plugin's elastic task, whose workers a subclass may launch itself (:meth:`launch`) for a
    ``start_method`` the plugin lacks; with ``spawn`` or ``fork`` it is the plugin's task, unchanged.
    The plugin's public ``execute`` calls ``_execute``, which this overrides."""

    def _execute(self, **kwargs) -> Any:
        if self.task_config.start_method in PLUGIN_START_METHODS:
            return super()._execute(**kwargs)
        return self.launch(kwargs)

    def launch(self, kwargs: Dict[str, Any]) -> Any:
        raise NotImplementedError(f"start_method={self.task_config.start_method!r}")


def adopt_rank0_result(result: ElasticWorkerResult) -> Any:
    """Rank 0's return value, its decks (but the timeline) and output metadata handed to this process's
    task context, as the plugin's own launch does."""
    ctx = flytekit.current_context()
    for deck in result.decks:
        if not isinstance(deck, flytekit.deck.deck.TimeLineDeck):
            ctx.decks.append(deck)
    if result.om:
        FlyteContextManager.current_context().output_metadata_tracker.add(result.return_value, result.om)
    return result.return_value
