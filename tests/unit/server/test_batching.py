"""Batcher: batch composition, routing of results to their request, delays and failures."""

import asyncio
import time

import pytest

from models.server.batching import Batcher


def _run(coro):
    return asyncio.run(coro)


class Recorder:
    """A batch function that records each batch and tags every item with its batch number."""

    def __init__(self, fail_on=None):
        self.batches, self.fail_on = [], fail_on

    def __call__(self, items):
        self.batches.append(list(items))
        if self.fail_on is not None and self.fail_on in items:
            raise RuntimeError(f"model failed on {self.fail_on}")
        return [(x, len(self.batches)) for x in items]


async def _submit_all(batcher, requests):
    await batcher.start()
    try:
        return await asyncio.gather(*(batcher.submit(r) for r in requests))
    finally:
        await batcher.stop()


def test_concurrent_requests_fill_batches_and_get_their_own_results():
    fn = Recorder()
    requests = [[f"r{i}"] for i in range(10)]
    out = _run(_submit_all(Batcher(fn, max_batch_size=4, max_delay_s=0.2), requests))
    assert [len(b) for b in fn.batches] == [4, 4, 2]
    assert out == [[(f"r{i}", i // 4 + 1)] for i in range(10)]


def test_requests_are_never_split_and_keep_their_order():
    fn = Recorder()
    requests = [["a0", "a1", "a2"], ["b0"], ["c0", "c1"], ["d0", "d1", "d2", "d3"]]
    batcher = Batcher(fn, max_batch_size=5, max_delay_s=0.2)
    out = _run(_submit_all(batcher, requests))
    # a+b = 4; c would make 6 → next batch; c+d = 6 → d alone
    assert fn.batches == [["a0", "a1", "a2", "b0"], ["c0", "c1"], ["d0", "d1", "d2", "d3"]]
    assert out == [[(x, 1) for x in requests[0]], [("b0", 1)], [(x, 2) for x in requests[2]],
                   [(x, 3) for x in requests[3]]]
    assert (batcher.stats.requests, batcher.stats.samples, batcher.stats.batches,
            batcher.stats.largest_batch) == (4, 10, 3, 4)


def test_a_request_larger_than_the_batch_runs_alone():
    fn = Recorder()
    out = _run(_submit_all(Batcher(fn, max_batch_size=2, max_delay_s=0.2), [list("abcde"), ["z"]]))
    assert fn.batches == [list("abcde"), ["z"]]
    assert out[0] == [(x, 1) for x in "abcde"]


@pytest.mark.parametrize("delay", [0.0, 0.15])
def test_a_lone_request_waits_at_most_the_delay(delay):
    async def one():
        batcher = Batcher(Recorder(), max_batch_size=8, max_delay_s=delay)
        await batcher.start()
        t0 = time.monotonic()
        await batcher.submit(["x"])
        elapsed = time.monotonic() - t0
        await batcher.stop()
        return elapsed

    elapsed = _run(one())
    assert delay <= elapsed < delay + 0.5


def test_a_failing_batch_fails_its_requests_only():
    fn = Recorder(fail_on="bad")

    async def scenario():
        batcher = Batcher(fn, max_batch_size=2, max_delay_s=0.2)
        await batcher.start()
        try:
            first = await asyncio.gather(batcher.submit(["ok"]), batcher.submit(["bad"]), return_exceptions=True)
            later = await batcher.submit(["fine"])
        finally:
            await batcher.stop()
        return first, later

    first, later = _run(scenario())
    assert all(isinstance(e, RuntimeError) and "model failed on bad" in str(e) for e in first)
    assert later == [("fine", 2)]


def test_wrong_result_count_is_an_error():
    async def scenario():
        batcher = Batcher(lambda items: items[:-1], max_batch_size=4, max_delay_s=0.0)
        await batcher.start()
        try:
            with pytest.raises(RuntimeError, match="returned 1 results for 2 items"):
                await batcher.submit(["a", "b"])
        finally:
            await batcher.stop()

    _run(scenario())
    with pytest.raises(ValueError, match="max_batch_size >= 1"):
        Batcher(Recorder(), max_batch_size=0, max_delay_s=0.1)
