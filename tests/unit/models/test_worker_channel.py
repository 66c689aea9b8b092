"""Pushes straight into each worker (models/engines/worker_channel.py), with two stand-in workers in this process
(the channel's members 1 and 2 over gloo, vLLM's loaders replaced by a recorder): each worker receives its share of
every bucket and loads what was sent there, streamed or kept; a worker whose load fails takes the rest of the push
in and drops it, so the sender and the other worker finish instead of waiting out the timeout; a worker that
cannot join says so at the push."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from models.engines import vllm_push, worker_channel
from models.engines.weight_channel import ChannelError, Receiver, Sender
from models.engines.weight_shares import share_nbytes
from models.engines.weight_stream import BucketWriter, plan_push

STATE = {"rows": torch.arange(48, dtype=torch.float32).reshape(12, 4), "norm": torch.ones(4)}
SHARES = [{"rows": [[0, [6, 4], [4, 1]]]}, {"rows": [[24, [6, 4], [4, 1]]]}]  # 6 rows each; the norm whole


def _buckets():
    header = plan_push([(n, list(t.shape), t.dtype) for n, t in STATE.items()], {}, bucket_bytes=64)
    out = []
    for i in range(len(header["buckets"])):
        writer = BucketWriter(header, i, torch.device("cpu"), torch.Generator().manual_seed(i))
        for entry in writer.entries:
            writer.put(entry[0], STATE[entry[0]])
        out.append(writer.seal())
    return header, out


@pytest.fixture
def channel(monkeypatch):
    """A receiver's store, two joined stand-in workers and the sender; what each worker's loader was given."""
    loaded = {0: {}, 1: {}}
    fail = {"worker": None}

    def chunk(worker, tensors=None, shared=None):
        if worker.rank == fail["worker"]:
            raise RuntimeError("the loader failed")
        loaded[worker.rank].update({k: v.clone() for k, v in tensors.items()})

    monkeypatch.setattr(worker_channel, "POLL_S", 0.1)  # the members' polls of the store: closed sooner
    monkeypatch.setattr(vllm_push, "begin", lambda worker: None)
    monkeypatch.setattr(vllm_push, "chunk", chunk)
    monkeypatch.setattr(vllm_push, "finish", lambda worker: [])
    receiver = Receiver("127.0.0.1", "", timeout_s=20, workers=["", ""])
    offer = {**receiver.offer(), "shares": SHARES}
    workers = [SimpleNamespace(rank=r, device=torch.device("cpu")) for r in (0, 1)]
    for w in workers:
        worker_channel.join(w, "127.0.0.1", offer, 20)
    sender = Sender("127.0.0.1", offer, timeout_s=20)
    yield SimpleNamespace(receiver=receiver, offer=offer, workers=workers, sender=sender, loaded=loaded, fail=fail)
    for w in workers:  # the members first: their threads wait on the receiver's store
        worker_channel._MEMBERS.pop(id(w)).close()
    sender.close()
    receiver.close()


def _push(ch, n: int, keep: bool):
    header, buckets = _buckets()
    worker_channel.announce(ch.receiver.store, ch.offer, n, header, n, keep)
    sent = threading.Thread(target=lambda: [ch.sender.send_shares(header, i, b) for i, b in enumerate(buckets)])
    sent.start()
    return header, sent


def _load_all(ch, n: int):
    out, threads = {}, []

    def load(w):
        try:
            out[w.rank] = worker_channel.load(w, n)
        except Exception as err:  # noqa: BLE001 -- what the worker's collective_rpc would raise
            out[w.rank] = err

    for w in ch.workers:
        threads.append(threading.Thread(target=load, args=(w,)))
        threads[-1].start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.parametrize("keep", [False, True])
def test_each_worker_receives_its_share_and_loads_what_was_sent_there(channel, keep):
    header, sent = _push(channel, 1, keep)
    if keep:  # received while the engine goes on; loaded when the push is served
        worker_channel.wait_received(channel.receiver.store, channel.offer, 1, 2, 20)
    out = _load_all(channel, 1)
    sent.join(30)
    for r in (0, 1):
        assert out[r]["problems"] == [] and set(out[r]["samples"]) == {"rows", "norm"}
        assert out[r]["bytes"] == sum(share_nbytes(header, i, SHARES[r]) for i in range(len(header["buckets"])))
        rows = channel.loaded[r]["rows"]
        assert torch.equal(rows[6 * r:6 * r + 6], STATE["rows"][6 * r:6 * r + 6])  # its rows, as sent
        assert torch.equal(channel.loaded[r]["norm"], STATE["norm"])
    assert len(header["buckets"]) == 2


def test_a_worker_whose_load_fails_drains_the_push_and_the_others_finish(channel):
    channel.fail["worker"] = 1
    t0 = time.monotonic()
    _, sent = _push(channel, 1, False)
    out = _load_all(channel, 1)
    sent.join(30)
    assert not sent.is_alive() and time.monotonic() - t0 < 15  # nobody waited for the 20-s timeout
    assert isinstance(out[1], RuntimeError) and out[0]["problems"] == []
    channel.fail["worker"] = None
    _, sent = _push(channel, 2, False)  # the next push goes through the same channel
    out = _load_all(channel, 2)
    sent.join(30)
    assert out[0]["problems"] == out[1]["problems"] == []


def test_a_worker_that_cannot_join_says_so_at_the_push():
    offer = {"port": 1, "backend": "gloo", "key": "k", "size": 2, "shares": None}
    worker = SimpleNamespace(rank=0, device=torch.device("cpu"))
    worker_channel.join(worker, "127.0.0.1", offer, 2)
    meanwhile = time.monotonic()
    with pytest.raises(ChannelError, match=r"worker 0 did not join the weight channel"):
        worker_channel.load(worker, 1)
    assert time.monotonic() - meanwhile < 10
    worker_channel._MEMBERS.pop(id(worker)).close()
