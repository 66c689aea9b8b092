"""The weight transports (models/hosts/transports.py) end to end over a real service: the collective channel (gloo
here) formed at the first push, a push the engine refuses before it takes the tensors, a new channel after, the
engine's end gone under a formed channel; the HTTP body. The engine's side is a plain host holding the
transport's receiving end and an engine of a dict (:class:`DictEngine`), as ``EngineHost`` holds a real one.

What a push must be (#38): at the engine's dtype (``resident/weights_bytes`` its bytes times the parameters),
streamed (the sender sends a bucket before it has gathered the last tensor; the receiver holds at most two
buckets at once), checked (a bucket corrupted on the way is refused before it is loaded; an engine that left a
tensor out, or kept its old weights, fails the push naming the tensor)."""

from __future__ import annotations

import threading
from typing import Dict, List

import pytest
import torch

from models.engines import weight_channel
from models.engines.weight_delta import stepped
from models.engines.weight_stream import bits
from models.hosts.transports import CollectiveTransport, HTTPTransport
from models.service.client import ServiceClient, ServiceError
from models.service.ops import Host, op
from models.service.server import Server, Settings
from models.training.distributed import DistInfo
from models.training.weight_shadow import Shadow
from models.training.weight_source import WeightSource

INFO = DistInfo(0, 1, 0, torch.device("cpu"))


class DictEngine:
    """The push side of an engine (``SwappableEngine``'s) over a dict: ``drop`` names a tensor its loader skips
    without a word (as vLLM's may), ``stale`` keeps the old weights whatever comes."""

    def __init__(self, state: Dict[str, torch.Tensor], drop: str = "", stale: bool = False):
        self.state, self.drop, self.stale = {k: v.clone() for k, v in state.items()}, drop, stale
        self.chunks: List[List[str]] = []
        self.closed = False

    def push_buffer(self, nbytes, device):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def begin_push(self, shapes):
        assert set(shapes) == set(self.state), set(shapes) ^ set(self.state)

    def push_chunk(self, tensors):
        self.chunks.append(list(tensors))
        for name, t in tensors.items():
            if name != self.drop and not self.stale:
                self.state[name] = t.to(self.state[name].dtype).clone()

    def end_push(self):
        pass

    def begin_patch(self, shapes):
        assert set(shapes) == set(self.state), set(shapes) ^ set(self.state)

    def patch_chunk(self, patches):
        self.chunks.append(list(patches))
        for name, patch in patches.items():
            if name == self.drop or self.stale:
                continue
            if patch.indices is None:
                self.state[name] = patch.values.to(self.state[name].dtype).clone()
            else:
                flat = self.state[name].view(-1)
                flat[patch.indices] = stepped(flat[patch.indices], patch)

    def end_patch(self):
        pass

    def abort_push(self):
        self.closed = True

    def read_back(self, positions, dtypes):
        return {name: [[b] for b in bits(self.state[name].reshape(-1)[where].to(getattr(torch, dtypes[name])))
                       .tolist()] for name, where in positions.items()}


class Engine(Host):
    """``refuse`` makes the next ``weights`` op fail before it takes the tensors, as a stale request would."""

    label = "the engine service"

    def __init__(self, transport, engine: DictEngine):
        self.transport, self.engine, self.refuse, self.keep = transport, engine, "", False

    @op
    def connect(self, host: str, gpu: str = "", timeout_s=None):
        return self.transport.connect(host=host, gpu=gpu, timeout_s=timeout_s, engine=self.engine)

    @op
    def weights(self, version: int, probe, meta=None, body=None):
        if self.refuse:
            reason, self.refuse = self.refuse, ""
            raise RuntimeError(reason)
        put = self.transport.receive(meta or {}, body, None if self.keep else self.engine)  # keep: as EngineHost's
        out = put(self.engine)
        return {**out, "version": version, "probe": probe}


def serve(transport, engine: DictEngine):
    host = Engine(transport, engine)
    server = Server(host, Settings("tok-en"))
    threading.Thread(target=server.serve, daemon=True).start()
    return server, host, ServiceClient(server.url, "tok-en", "the engine service")


def weights(rows: int = 64) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    out = {"embed": torch.randn(rows, 8, generator=gen), "norm": torch.ones(8, dtype=torch.bfloat16),
           "steps": torch.tensor([3, 4])}
    out["head"] = out["embed"]
    return out


def held(engine: DictEngine) -> Dict[str, torch.Tensor]:
    return {k: v for k, v in engine.state.items()}


def test_weights_over_the_collective_channel_and_a_refused_push():
    state = weights()
    server, host, client = serve(CollectiveTransport(), DictEngine({k: v for k, v in state.items() if k != "head"}))
    sender = CollectiveTransport(timeout_s=10)
    out = sender.send(client, {"version": 1, "probe": [0.5]}, None, WeightSource(state, INFO))
    assert out["version"] == 1 and out["probe"] == [0.5] and out["resident/weights_transport"] == 1.0  # gloo
    assert out["resident/weights_bytes"] == (64 * 8 + 8) * 4 + 2 * 8  # float32 engine: the tied head once
    assert all(torch.equal(host.engine.state[k], v) for k, v in state.items() if k != "head")
    host.refuse = "the engine holds the policy of iteration 0"
    with pytest.raises(ServiceError, match=r"the weights of iteration 2 to the engine service at .* over the "
                                           r"collective transport \(gloo\) failed: .*the receiver gave up .*"
                                           r"iteration 0"):
        sender.send(client, {"version": 2, "probe": []}, None, WeightSource(state, INFO))
    state["embed"] = state["head"] = state["embed"] * 2
    assert sender.send(client, {"version": 2, "probe": []}, None, WeightSource(state, INFO))["version"] == 2
    assert torch.equal(host.engine.state["embed"], state["embed"])  # a new channel
    host.transport.close()  # the engine's end gone under a formed channel (as when the engine is killed)
    with pytest.raises(ServiceError, match=r"the weights of iteration 3 to the engine service at .* over the "
                                           r"collective transport \(gloo\) failed"):
        sender.send(client, {"version": 3, "probe": []}, None, WeightSource(state, INFO))
    client.call("stop")
    server.close()


def test_weights_in_the_http_body():
    state = weights()
    server, host, client = serve(HTTPTransport(), DictEngine({k: v for k, v in state.items() if k != "head"}))
    out = HTTPTransport("bfloat16").send(client, {"version": 1, "probe": []}, None, WeightSource(state, INFO))
    assert out["version"] == 1 and out["resident/weights_transport"] == 0.0
    assert out["resident/weights_bytes"] == (64 * 8 + 8) * 2 + 2 * 8  # at the engine's dtype
    assert torch.equal(host.engine.state["embed"], state["embed"].bfloat16().float())
    client.call("stop")
    server.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_push_is_at_the_engine_dtype_and_streamed_bucket_by_bucket(dtype, monkeypatch):
    """A 40-bucket state: every bucket sent before the source gathers the next bucket's first tensor, the receiver
    holding at most two buckets' bytes at once; the engine gets exactly the trainer's tensors cast to its dtype."""
    rows, bucket = 10, 4096
    state = {f"layers.{i}.w": torch.randn(rows * 10, 10, generator=torch.Generator().manual_seed(i))
             for i in range(40)}  # 4000 float32 bytes each: one a bucket at float32, two at bfloat16
    events: List[str] = []
    source = WeightSource(state, INFO)
    gathered = source.gathered
    source.gathered = lambda *a: ((events.append(f"gather {n}"), (n, t))[1] for n, t in gathered(*a))
    send_bucket = weight_channel.Sender.send_bucket
    monkeypatch.setattr(weight_channel.Sender, "send_bucket",
                        lambda self, b: (events.append("send"), send_bucket(self, b))[1])
    engine = DictEngine({k: torch.zeros_like(v, dtype=getattr(torch, dtype)) for k, v in state.items()})
    server, host, client = serve(CollectiveTransport(), engine)
    out = CollectiveTransport(dtype, bucket_bytes=bucket, timeout_s=10).send(client, {"version": 1, "probe": []},
                                                                             None, source)
    width = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    params = sum(t.numel() for t in state.values())
    assert out["resident/weights_bytes"] == width * params == out["resident/weights_params"] * width
    assert all(torch.equal(bits(engine.state[k]), bits(v.to(getattr(torch, dtype)))) for k, v in state.items())
    buckets = events.count("send")
    assert buckets == (40 if width == 4 else 20) and len(engine.chunks) == buckets
    assert events.index("send") < events.index("gather layers.39.w")  # streamed, not gathered whole first
    assert out["resident/receiver_peak_bytes"] <= 2 * (bucket + 16 * 8 * 2 + 8)  # two buckets, samples included
    assert out["resident/receiver_peak_bytes"] * 5 < width * params  # not the whole state (20 or 40 buckets)
    client.call("stop")
    server.close()


def test_a_kept_push_lands_in_host_memory_two_buckets_at_most_where_it_arrives(monkeypatch):
    """Deferred or asynchronous (the push kept until it is served, while the engine generates): each bucket is copied
    to host memory as it arrives and the channel's buffer (an NCCL push's: on the engine's GPU) let go before the next
    is received, so at most two are alive where the push lands, not the whole push; the engine then gets them from
    the host, exactly the trainer's tensors."""
    state = {f"layers.{i}.w": torch.randn(100, 10, generator=torch.Generator().manual_seed(i)) for i in range(24)}
    engine, devices = DictEngine({k: torch.zeros_like(v) for k, v in state.items()}), []
    push_chunk = engine.push_chunk
    engine.push_chunk = lambda tensors: (devices.extend(t.device.type for t in tensors.values()), push_chunk(tensors))
    server, host, client = serve(CollectiveTransport(), engine)
    host.keep = True
    out = CollectiveTransport(bucket_bytes=4096, timeout_s=10).send(client, {"version": 1, "probe": []}, None,
                                                                    WeightSource(state, INFO))
    bucket = 4000 + 16 * 8 * 2 + 8  # one tensor a bucket, its samples and checksum
    assert out["resident/receiver_peak_bytes"] <= 2 * bucket  # two alive where the push lands, of 24 received
    assert len(engine.chunks) == 24 and set(devices) == {"cpu"}
    assert all(torch.equal(engine.state[k], v) for k, v in state.items())
    assert out["resident/receiver_host_bytes"] >= 24 * 4000  # the whole push, on the host
    client.call("stop")
    server.close()


def test_a_bucket_corrupted_on_the_way_is_refused_before_it_is_loaded(monkeypatch):
    state = {f"w{i}": torch.randn(100, 10, generator=torch.Generator().manual_seed(i)) for i in range(4)}
    send_bucket, sent = weight_channel.Sender.send_bucket, []

    def flip(self, buffer):
        sent.append(1)
        if len(sent) == 3:
            buffer[5] ^= 1  # one bit of bucket 2 (its first tensor, w2)
        send_bucket(self, buffer)

    monkeypatch.setattr(weight_channel.Sender, "send_bucket", flip)
    engine = DictEngine({k: torch.zeros_like(v) for k, v in state.items()})
    server, host, client = serve(CollectiveTransport(), engine)
    with pytest.raises(ServiceError, match=r"bucket 2 of the push arrived other than it was sent .* "
                                           r"it holds \['w2'\]"):
        CollectiveTransport(bucket_bytes=4000, timeout_s=10).send(client, {"version": 1, "probe": []}, None,
                                                                  WeightSource(state, INFO))
    assert engine.chunks == [["w0"], ["w1"]] and engine.closed  # w2 never loaded; the engine gives up the push
    client.call("stop")
    server.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("fault", ["drop", "stale"])
def test_an_engine_that_did_not_load_what_was_sent_fails_the_push_naming_the_tensor(dtype, fault):
    state = {"model.embed.weight": torch.randn(50, 8), "model.layers.0.mlp.weight": torch.randn(8, 8),
             "model.norm.weight": torch.randn(8)}
    old = {k: (v + 1).to(getattr(torch, dtype)) for k, v in state.items()}
    engine = DictEngine(old, drop="model.layers.0.mlp.weight" if fault == "drop" else "", stale=fault == "stale")
    server, host, client = serve(HTTPTransport(), engine)
    which = "model.layers.0.mlp.weight" if fault == "drop" else "model.embed.weight"
    with pytest.raises(ServiceError, match=rf"reading the weights back: the engine holds other weights than were "
                                           rf"sent in '{which}': element \d+ holds bits 0x[0-9a-f]+ where the "
                                           rf"trainer sent 0x[0-9a-f]+"):
        HTTPTransport(dtype).send(client, {"version": 1, "probe": []}, None, WeightSource(state, INFO))
    client.call("stop")
    server.close()


@pytest.mark.parametrize("kind, dtype", [("collective", "bfloat16"), ("http", "bfloat16"), ("http", "float32")])
def test_a_delta_push_sends_what_changed_and_the_engine_holds_the_new_weights_bit_for_bit(kind, dtype):
    """A full push first (kept as the engine's copy), then two changed elements: 8 + 2 bytes each at bfloat16 (int32
    position padded to 8, the element), 8 + 4 at float32, density 2 of 2050; a delta against a push the engine does
    not hold is refused before anything is loaded; an engine that skipped a tensor's delta fails the read-back naming
    it (a sample among the changed elements lands on it)."""
    gen = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(200, 10, generator=gen), "b": torch.randn(50, generator=gen)}
    engine = DictEngine({k: torch.zeros_like(v, dtype=getattr(torch, dtype)) for k, v in state.items()})
    server, host, client = serve(CollectiveTransport() if kind == "collective" else HTTPTransport(), engine)
    sender = CollectiveTransport(dtype, timeout_s=10) if kind == "collective" else HTTPTransport(dtype)
    shadow = Shadow()
    first = sender.send(client, {"version": 1, "probe": []}, None, WeightSource(state, INFO),
                        {"id": "p1", "seed": 1, "base": ""}, shadow)
    size = torch.finfo(getattr(torch, dtype)).bits // 8
    assert first["resident/weights_bytes"] == 2050 * size and first["resident/push_density"] == 1.0
    assert engine.pushed == "p1"
    state["a"][3, 4] += 1.0
    state["b"][7] = -state["b"][7]
    out = sender.send(client, {"version": 2, "probe": []}, None, WeightSource(state, INFO),
                      {"id": "p2", "seed": 2, "base": "p1"}, shadow)
    assert out["resident/weights_bytes"] == 2 * (8 + size) and out["resident/push_density"] == 2 / 2050
    assert all(torch.equal(bits(engine.state[k]), bits(v.to(getattr(torch, dtype)))) for k, v in state.items())
    with pytest.raises(ServiceError, match=r"the delta push p3 builds on push p1, but the engine holds p2"):
        sender.send(client, {"version": 3, "probe": []}, None, WeightSource(state, INFO),
                    {"id": "p3", "seed": 3, "base": "p1"}, shadow)
    engine.pushed, engine.drop = "p2", "a"
    state["a"][5, 5] += 1.0
    with pytest.raises(ServiceError, match=r"the engine holds other weights than were sent in 'a'"):
        sender.send(client, {"version": 3, "probe": []}, None, WeightSource(state, INFO),
                    {"id": "p4", "seed": 4, "base": "p2"}, shadow)
    client.call("stop")
    server.close()
