"""Dynamic batching of concurrent requests: an asyncio queue and one worker.

The worker takes the first waiting request, then keeps collecting requests until the batch
holds ``max_batch_size`` samples or ``max_delay_s`` has passed since that first request
arrived; it runs ``run_batch`` on the concatenated samples in a thread (the event loop
stays free to accept requests), and hands each request its own slice of the results, in
order. A request is never split: one that would overflow the batch waits for the next one,
and a request larger than ``max_batch_size`` runs alone. If ``run_batch`` raises, every
request of that batch gets the exception; later batches are unaffected.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence


@dataclass
class BatchStats:
    """Counters since start (read by ``/health``)."""

    requests: int = 0
    samples: int = 0
    batches: int = 0
    largest_batch: int = 0


@dataclass
class _Pending:
    items: Sequence[Any]
    future: asyncio.Future


class Batcher:
    """``await submit(items)`` → ``run_batch``'s results for exactly those items."""

    def __init__(self, run_batch: Callable[[List[Any]], List[Any]], max_batch_size: int, max_delay_s: float):
        if max_batch_size < 1 or max_delay_s < 0:
            raise ValueError(f"need max_batch_size >= 1 and max_delay_s >= 0, got {max_batch_size}, {max_delay_s}")
        self.run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self.stats = BatchStats()
        self._queue: Optional[asyncio.Queue] = None
        self._carry: Optional[_Pending] = None  # did not fit in the previous batch
        self._worker: Optional[asyncio.Task] = None

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._run(), name="infer-batcher")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None

    async def submit(self, items: Sequence[Any]) -> List[Any]:
        if self._queue is None:
            raise RuntimeError("Batcher.submit before start()")
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(list(items), future))
        return await future

    async def _collect(self) -> List[_Pending]:
        """The next batch: the carried-over or first request, then more until full or late."""
        first = self._carry or await self._queue.get()
        self._carry = None
        deadline = time.monotonic() + self.max_delay_s
        batch, size = [first], len(first.items)
        while size < self.max_batch_size:
            remaining = deadline - time.monotonic()
            try:
                nxt = self._queue.get_nowait() if remaining <= 0 else \
                    await asyncio.wait_for(self._queue.get(), remaining)
            except (asyncio.QueueEmpty, asyncio.TimeoutError):
                break
            if size + len(nxt.items) > self.max_batch_size:
                self._carry = nxt
                break
            batch.append(nxt)
            size += len(nxt.items)
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [p for p in await self._collect() if not p.future.done()]  # drop cancelled requests
            if not batch:
                continue
            flat = [item for p in batch for item in p.items]
            self.stats.requests += len(batch)
            self.stats.samples += len(flat)
            self.stats.batches += 1
            self.stats.largest_batch = max(self.stats.largest_batch, len(flat))
            try:
                results = await loop.run_in_executor(None, self.run_batch, flat)
                if len(results) != len(flat):
                    raise RuntimeError(f"batch function returned {len(results)} results for {len(flat)} items")
            except Exception as err:  # noqa: BLE001 - handed to every waiting request
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(err)
                continue
            start = 0
            for p in batch:
                if not p.future.done():
                    p.future.set_result(results[start:start + len(p.items)])
                start += len(p.items)
