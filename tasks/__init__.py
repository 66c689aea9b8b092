"""Flyte tasks (one module per stage) and the Flyte support beside them (the floor plan:
docs/development.md). Importing any of them quiets the libraries' console chatter
(``models/console.py``; ``RLHF_VERBOSE=1`` keeps it) and turns torch's huge pages on (``models/memory.py``,
:func:`~models.memory.use_huge_pages`): this runs first in every process that runs a
task (``pyflyte run``, a pod's ``pyflyte-execute``, an elastic worker), before torch, transformers,
vLLM or flytekit's own settings load. Under ``pyflyte`` it also makes a config error print its one-line
reason (``tasks/cli_errors.py``), and everywhere flytekit computes each dataclass's Flyte type once per
process instead of once per task interface, and each task's name is told to the run's keeper as it starts
(``tasks/flyte_internals.py``)."""

from models.console import quiet_libraries
from models.library_imports import skip_unused_optional_imports
from models.memory import use_huge_pages

quiet_libraries()
skip_unused_optional_imports()  # transformers without scikit-learn: ~4 s of CPU less per process
use_huge_pages()  # torch's large CPU allocations by 2 MiB pages, here and in every process started from here

from tasks.cli_errors import short_config_errors  # noqa: E402  (imports flytekit: after the line above)
from models.run.keeper import note_task  # noqa: E402
from tasks.flyte_internals import cache_dataclass_literal_types, note_each_task  # noqa: E402

short_config_errors()
cache_dataclass_literal_types()  # before any task is defined: ~5 s less per process importing the workflows
note_each_task(note_task)  # the task running, for the run's keeper (models/run/keeper.py)
