"""A trainer's push as the engine service receives it, for the producer tests: from another thread, through
:class:`models.hosts.producer.EngineTurns` (the ``weights`` op), once ``ready()`` returns."""

from __future__ import annotations

import threading
import time
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


def take_ahead(producer, take: Callable[[int], object], turns, served: Dict[str, int], iterations: int, k: int,
               load: Callable[[int], None] = lambda version: None) -> List:
    """Iterations 0 … ``iterations − 1`` taken by ``take(i)`` one after the other, each followed, once the producer
    has run ahead to draw version + k (and no further), by the trainer's push of version i + 1 (``load(i + 1)``
    first); the producer closed at the end. What ``producer.take`` gave each iteration (its units and window), and
    ``take``'s results."""
    original, taken, outs = producer.take, [], []
    producer.take = lambda i, timeout_s: taken.append(original(i, timeout_s)) or taken[-1]
    try:
        for i in range(iterations):
            outs.append(take(i))
            ahead = min(served["version"] + k + 1, iterations)
            deadline = time.monotonic() + 60
            while producer.next[0] < ahead and time.monotonic() < deadline:
                time.sleep(0.05)
            assert producer.next == (ahead, 0) and not producer.todo
            with turns.op():  # the trainer's push of version i + 1
                load(i + 1)
                served["version"] = i + 1
            producer.poke()
    finally:
        producer.close()
    assert not producer.thread.is_alive()
    return taken, outs
