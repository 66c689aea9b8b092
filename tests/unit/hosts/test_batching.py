"""Batcher (models/hosts/reward_critic.py): batch composition, routing of results to their call, delays and
failures, with calls from concurrent threads."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from models.hosts.reward_critic import Batcher


class Recorder:
    """A batch function that records each batch and tags every item with its batch number."""

    def __init__(self, fail_on=None):
        self.batches, self.fail_on = [], fail_on

    def __call__(self, items):
        self.batches.append(list(items))
        if self.fail_on is not None and self.fail_on in items:
            raise RuntimeError(f"model failed on {self.fail_on}")
        return [(x, len(self.batches)) for x in items]


def submit_all(batcher, requests, gap_s=0.01):
    """Each request from its own thread, in order (``gap_s`` apart, so the queue keeps their order)."""
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = []
        for r in requests:
            futures.append(pool.submit(batcher.submit, r))
            time.sleep(gap_s)
        return [f.result() for f in futures]


def test_concurrent_requests_fill_batches_and_get_their_own_results():
    fn = Recorder()
    out = submit_all(Batcher(fn, max_batch_size=4, max_delay_s=0.5), [[f"r{i}"] for i in range(10)])
    assert [len(b) for b in fn.batches] == [4, 4, 2]
    assert out == [[(f"r{i}", i // 4 + 1)] for i in range(10)]


def test_requests_are_never_split_and_keep_their_order():
    fn = Recorder()
    requests = [["a0", "a1", "a2"], ["b0"], ["c0", "c1"], ["d0", "d1", "d2", "d3"]]
    batcher = Batcher(fn, max_batch_size=5, max_delay_s=0.5)
    out = submit_all(batcher, requests)
    # a+b = 4; c would make 6 → next batch; c+d = 6 → d alone
    assert fn.batches == [["a0", "a1", "a2", "b0"], ["c0", "c1"], ["d0", "d1", "d2", "d3"]]
    assert out == [[(x, 1) for x in requests[0]], [("b0", 1)], [(x, 2) for x in requests[2]],
                   [(x, 3) for x in requests[3]]]
    assert batcher.stats == {"requests": 4, "samples": 10, "batches": 3, "largest_batch": 4}


def test_a_request_larger_than_the_batch_runs_alone():
    fn = Recorder()
    out = submit_all(Batcher(fn, max_batch_size=2, max_delay_s=0.5), [list("abcde"), ["z"]])
    assert fn.batches == [list("abcde"), ["z"]]
    assert out[0] == [(x, 1) for x in "abcde"]


@pytest.mark.parametrize("delay", [0.0, 0.15])
def test_a_lone_request_waits_at_most_the_delay(delay):
    batcher = Batcher(Recorder(), max_batch_size=8, max_delay_s=delay)
    t0 = time.monotonic()
    batcher.submit(["x"])
    assert delay <= time.monotonic() - t0 < delay + 0.5


def test_a_failing_batch_fails_its_requests_only():
    fn = Recorder(fail_on="bad")
    batcher = Batcher(fn, max_batch_size=2, max_delay_s=0.5)
    with ThreadPoolExecutor(2) as pool:
        first = [pool.submit(batcher.submit, ["ok"]), pool.submit(batcher.submit, ["bad"])]
        errors = [f.exception() for f in first]
    assert all(isinstance(e, RuntimeError) and "model failed on bad" in str(e) for e in errors)
    assert batcher.submit(["fine"]) == [("fine", 2)]


def test_wrong_result_count_is_an_error():
    batcher = Batcher(lambda items: items[:-1], max_batch_size=4, max_delay_s=0.0)
    with pytest.raises(RuntimeError, match="returned 1 results for 2 items"):
        batcher.submit(["a", "b"])
    with pytest.raises(ValueError, match="max_batch_size >= 1"):
        Batcher(Recorder(), max_batch_size=0, max_delay_s=0.1)
