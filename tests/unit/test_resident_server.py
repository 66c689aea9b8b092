"""The resident services' HTTP face and rank loop (models/resident/server.py, protocol.py) with a plain
handler: the token, the reply, a failed op, the binary weights body, the stops (op, idle, parent gone); the
weights over the collective channel (models/resident/channel.py) to a handler holding the engine's end."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from models.resident import protocol
from models.resident.channel import WeightReceiver, WeightSender
from models.resident.server import RankFanout, ServiceServer, serve
from models.run.layout import RunLayout


class Handler:
    def __init__(self):
        self.seen = []

    def __call__(self, op, args, body):
        self.seen.append((op, args, None if body is None else bytes(body)))
        if op == "boom":
            raise ValueError("the batch names iteration 7")
        return {"op": op, "n": len(self.seen)}


def _start(**kw):
    server = ServiceServer("tok-en", **kw)
    handler = Handler()
    out = {}
    thread = threading.Thread(target=lambda: out.update(reason=serve(server, RankFanout(), handler, lambda s: None)),
                              daemon=True)
    thread.start()
    return server, handler, thread, out


def test_calls_token_errors_and_the_stop_op(tmp_path):
    server, handler, thread, out = _start()
    address = protocol.ServiceAddress("actor", server.url, "tok-en", 1)
    assert protocol.call(address, "score", {"x": 1}) == {"op": "score", "n": 1}
    with pytest.raises(protocol.ServiceError, match=r"the actor trainer service at .* failed: ValueError: the batch "
                                                    r"names iteration 7"):
        protocol.call(address, "boom", {})
    with pytest.raises(protocol.ServiceError, match="Unauthorized: missing or wrong token"):
        protocol.call(protocol.ServiceAddress("actor", server.url, "wrong", 1), "score", {})
    assert [op for op, _, _ in handler.seen] == ["score", "boom"]  # the refused call never reached the handler
    assert protocol.post_weights(address, {"version": 3}, b"\x00\x01tensors")["op"] == "weights"
    assert handler.seen[-1] == ("weights", {"version": 3}, b"\x00\x01tensors")
    assert protocol.call(address, "stop", {"reason": "the run ended"}) == {"stopped": "the run ended"}
    thread.join(5)
    assert out["reason"] == "the run ended"
    server.close()
    with pytest.raises(protocol.ServiceGone, match=r"the actor trainer service at .* does not answer"):
        protocol.call(address, "score", {}, timeout_s=5)


def test_idle_timeout_and_a_gone_parent_stop_the_service():
    server, _, thread, out = _start(idle_timeout_s=0.5)
    thread.join(10)
    assert "no request for 0.5 s" in out["reason"]
    server.close()
    parent = subprocess.Popen([sys.executable, "-c", "pass"])
    parent.wait()
    server, _, thread, out = _start(parent_pid=parent.pid)
    thread.join(10)
    assert out["reason"] == f"the run's process {parent.pid} is gone"
    server.close()


def test_find_names_a_service_that_never_published(tmp_path):
    layout = RunLayout(str(tmp_path), "r1")
    with pytest.raises(protocol.ServiceGone, match=r"the engine service of run r1 has not published an address"):
        protocol.find(layout, "engine")
    protocol.publish(layout, protocol.ServiceAddress("engine", "http://127.0.0.1:1", "t", 42, "launch-1"))
    assert protocol.find(layout, "engine").pid == 42
    protocol.unpublish(layout, "engine")
    with pytest.raises(protocol.ServiceGone):
        protocol.find(layout, "engine")


def test_a_cluster_task_waits_for_its_own_launch_and_finish_stops_it(tmp_path):
    """On a cluster the services start beside the first tasks: a task waits for an address of its own
    execution, never an earlier launch's; ``finish_run``'s stop reaches the published services of its launch
    only, and removes their addresses."""
    from models.resident.lifecycle import stop_services
    from models.resident.service import cluster_addresses

    layout = RunLayout(str(tmp_path), "r1")
    protocol.publish(layout, protocol.ServiceAddress("engine", "http://127.0.0.1:1", "t", 41, "exec-old"))
    try:
        protocol.expect_launch("exec-new", wait_s=1.5)
        with pytest.raises(protocol.ServiceGone, match=r"belongs to launch 'exec-old', not to this one \('exec-new'\).*"
                                                       r"run.resident_start_timeout_s"):
            protocol.find(layout, "engine")
        server, _, thread, out = _start()
        later = threading.Timer(0.5, protocol.publish, (layout, protocol.ServiceAddress(
            "engine", server.url, "tok-en", 42, "exec-new")))
        later.start()
        assert protocol.find(layout, "engine").pid == 42  # waited for it
        protocol.publish(layout, protocol.ServiceAddress("critic", "http://127.0.0.1:1", "t", 43, "exec-other"))
        assert stop_services(layout, launch="exec-new") == ["engine"]
        thread.join(5)
        assert out["reason"] == "the run finished" and server.requests == 1
        assert not (tmp_path / "r1" / "services" / "engine.json").exists()
        assert (tmp_path / "r1" / "services" / "critic.json").exists()  # another launch's: left alone
        server.close()
    finally:
        protocol.expect_launch("")
    assert cluster_addresses({"RLHF_SERVICE_HOST": "127.0.0.1"}) == ("127.0.0.1", "127.0.0.1")
    assert cluster_addresses({})[0] == "0.0.0.0"


class Engine:
    """The engine service's side of the weights ops on the real channel end (models/resident/channel.py);
    ``refuse`` makes the next ``weights`` op fail before it takes the tensors, as a stale request would."""

    def __init__(self):
        self.channel, self.got, self.refuse = WeightReceiver(), None, ""

    def __call__(self, op, args, body):
        if op == "channel":
            return self.channel.open(args)
        if self.refuse:
            reason, self.refuse = self.refuse, ""
            raise RuntimeError(reason)
        self.got = self.channel.receive(args)
        return {"version": args["version"], "probe": args["probe"]}


def test_weights_over_the_collective_channel_and_a_refused_push(tmp_path):
    import torch

    server, engine = ServiceServer("tok-en"), Engine()
    threading.Thread(target=serve, args=(server, RankFanout(), engine, lambda s: None), daemon=True).start()
    address = protocol.ServiceAddress("engine", server.url, "tok-en", 1)
    weights = {"embed": torch.randn(64, 8), "norm": torch.ones(8, dtype=torch.bfloat16)}
    weights["head"] = weights["embed"]
    sender = WeightSender(timeout_s=10)
    out = sender.push(address, {"version": 1, "probe": [0.5]}, weights)
    assert out["version"] == 1 and out["probe"] == [0.5] and out["resident/weights_transport"] == 1.0  # gloo
    assert out["resident/weights_bytes"] == 64 * 8 * 4 + 8 * 2  # the tied head once
    assert all(torch.equal(engine.got[k], v) for k, v in weights.items()) and engine.got["head"] is engine.got["embed"]
    engine.refuse = "the engine holds the policy of iteration 0"
    with pytest.raises(protocol.ServiceError, match=r"the weights of iteration 2 to the engine service at .* over the "
                                                    r"collective transport \(gloo\) failed: .*the receiver gave up .*"
                                                    r"iteration 0"):
        sender.push(address, {"version": 2, "probe": []}, weights)
    weights["norm"] = weights["norm"] * 2
    assert sender.push(address, {"version": 2, "probe": []}, weights)["version"] == 2  # a new channel
    assert torch.equal(engine.got["norm"], weights["norm"])
    engine.channel.close()  # the engine's end gone under a formed channel (as when the engine is killed)
    with pytest.raises(protocol.ServiceError, match=r"the weights of iteration 3 to the engine service at .* over the "
                                                    r"collective transport \(gloo\) failed"):
        sender.push(address, {"version": 3, "probe": []}, weights)
    protocol.call(address, "stop", {})
    server.close()
