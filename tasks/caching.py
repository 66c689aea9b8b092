"""Flyte's caching of the stage tasks. Importing this module also registers RolloutBatch as a Flyte
type (:mod:`tasks.batch_type`), which every task module that passes a batch needs."""

from tasks import batch_type  # noqa: F401  (registers RolloutBatch as a Flyte type for the tasks)

CACHE_VERSION = "2"
"""Bump when a task's outputs change meaning for the same inputs."""
