"""Flyte's caching of the stage tasks. Importing this module also registers RolloutBatch as a Flyte
type (:mod:`tasks.batch_type`), which every task module that passes a batch needs."""

from tasks import batch_type  # noqa: F401  (registers RolloutBatch as a Flyte type for the tasks)

CACHE_VERSION = "2"
"""Bump when a task's outputs change meaning for the same inputs."""

CACHED = dict(cache=True, cache_version=CACHE_VERSION, cache_ignore_input_vars=("launch",))
"""The stage tasks' cache settings. A task's ``launch`` input (the holder of the run's lock, which it renews:
:attr:`models.run.types.RunHandle.launch`) is left out of the key, as it changes with every launch of a run:
a relaunch reuses the outputs the launch before it cached (docs/reliability_faults.md)."""
