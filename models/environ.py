"""Environment variables set for the length of a block, then each as it was (unset if it was unset): for
settings a library or a child process reads when it starts (vLLM's CPU binding, the threads of an elastic
launch's workers, MLflow's retries), which must not stay behind for what the process does later; and this
machine's cache folder (``RLHF_CACHE_DIR``)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping


CACHE_ENV = "RLHF_CACHE_DIR"


def cache_dir() -> str:
    """This machine's cache of what can be made again (the demos' warm-started models, MLflow's empty store):
    ``RLHF_CACHE_DIR``, default ``~/.cache/flyte-rlhf``."""
    return os.environ.get(CACHE_ENV, os.path.join(os.path.expanduser("~"), ".cache", "flyte-rlhf"))


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
