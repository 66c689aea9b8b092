"""The weight transports (models/hosts/transports.py) end to end over a real service: the collective channel (gloo
here) formed at the first push, a push the engine refuses before it takes the tensors, a new channel after, the
engine's end gone under a formed channel; the HTTP body. The engine's side is a plain host holding the
transport's receiving end, as ``EngineHost`` does."""

from __future__ import annotations

import threading

import pytest
import torch

from models.hosts.transports import CollectiveTransport, HTTPTransport
from models.service.client import ServiceClient, ServiceError
from models.service.ops import Host, op
from models.service.server import Server, Settings


class Engine(Host):
    """``refuse`` makes the next ``weights`` op fail before it takes the tensors, as a stale request would."""

    label = "the engine service"

    def __init__(self, transport):
        self.transport, self.got, self.refuse = transport, None, ""

    def load_tensors(self, tensors):
        self.got = tensors

    @op
    def connect(self, host: str, gpu: str = "", timeout_s=None):
        return self.transport.connect(host=host, gpu=gpu, timeout_s=timeout_s)

    @op
    def weights(self, version: int, probe, meta=None, body=None):
        if self.refuse:
            reason, self.refuse = self.refuse, ""
            raise RuntimeError(reason)
        self.transport.receive(meta or {}, body)(self)
        return {"version": version, "probe": probe}


def serve(transport):
    engine = Engine(transport)
    server = Server(engine, Settings("tok-en"))
    threading.Thread(target=server.serve, daemon=True).start()
    return server, engine, ServiceClient(server.url, "tok-en", "the engine service")


def weights():
    out = {"embed": torch.randn(64, 8), "norm": torch.ones(8, dtype=torch.bfloat16)}
    out["head"] = out["embed"]
    return out


def test_weights_over_the_collective_channel_and_a_refused_push():
    server, engine, client = serve(CollectiveTransport())
    state, sender = weights(), CollectiveTransport(timeout_s=10)
    out = sender.send(client, {"version": 1, "probe": [0.5]}, None, state)
    assert out["version"] == 1 and out["probe"] == [0.5] and out["resident/weights_transport"] == 1.0  # gloo
    assert out["resident/weights_bytes"] == 64 * 8 * 4 + 8 * 2  # the tied head once
    assert all(torch.equal(engine.got[k], v) for k, v in state.items()) and engine.got["head"] is engine.got["embed"]
    engine.refuse = "the engine holds the policy of iteration 0"
    with pytest.raises(ServiceError, match=r"the weights of iteration 2 to the engine service at .* over the "
                                           r"collective transport \(gloo\) failed: .*the receiver gave up .*"
                                           r"iteration 0"):
        sender.send(client, {"version": 2, "probe": []}, None, state)
    state["norm"] = state["norm"] * 2
    assert sender.send(client, {"version": 2, "probe": []}, None, state)["version"] == 2  # a new channel
    assert torch.equal(engine.got["norm"], state["norm"])
    engine.transport.close()  # the engine's end gone under a formed channel (as when the engine is killed)
    with pytest.raises(ServiceError, match=r"the weights of iteration 3 to the engine service at .* over the "
                                           r"collective transport \(gloo\) failed"):
        sender.send(client, {"version": 3, "probe": []}, None, state)
    client.call("stop")
    server.close()


def test_weights_in_the_http_body():
    server, engine, client = serve(HTTPTransport())
    state = weights()
    out = HTTPTransport().send(client, {"version": 1, "probe": []}, None, state)
    assert out["version"] == 1 and out["resident/weights_transport"] == 0.0 and out["resident/weights_bytes"] > 2048
    assert all(torch.equal(engine.got[k], v) for k, v in state.items())
    client.call("stop")
    server.close()
