"""Wall-clock timing of a stage's phases, as the ``time/*`` metrics a run logs."""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator


@contextlib.contextmanager
def timed(stats: Dict[str, float], key: str) -> Iterator[None]:
    """Add the seconds the block took to ``stats[key]`` (also when it raises)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        stats[key] = stats.get(key, 0.0) + time.perf_counter() - t0
