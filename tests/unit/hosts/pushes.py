"""A trainer's push as the engine service receives it, for the producer tests: from another thread, through
:class:`models.hosts.producer.EngineTurns` (the ``weights`` op), once ``ready()`` returns."""

from __future__ import annotations

import threading
from typing import Callable, Dict, List


def push_later(ready: Callable[[], object], turns, engine, checkpoint: str, served: Dict[str, int],
               version: int) -> threading.Thread:
    """A started thread that waits for ``ready()``, then loads ``checkpoint`` into ``engine`` as ``version``."""

    def push() -> None:
        ready()
        with turns.op():
            engine.load_weights(checkpoint)
            served["version"] = version

    thread = threading.Thread(target=push)
    thread.start()
    return thread


def take_once(producer, thread: threading.Thread, iteration: int = 0) -> List:
    """The units of ``iteration`` (the producer closed and the push joined afterwards, whatever happens)."""
    try:
        units, _ = producer.take(iteration, timeout_s=120)
    finally:
        producer.close()
        thread.join(10)
    return units
