"""A resident service's wiring (models/hosts/resident.py with models/stages/services.py), around a host that holds
no model: it publishes its address for the run handle's launch, a stage is called with the iteration's state and
batch only, and the service refuses a request that carries a config, names a location outside the run's folder or
was sent for another config; ``finish_run``'s stop ends it with its summary."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading

import pytest

from models.config.io import load_config
from models.hosts import resident
from models.run.types import PolicyState, RunHandle
from models.service import book
from models.service.client import ServiceClient, ServiceError
from models.service.ops import Host, op
from models.service.token import SECRET_ENV, service_token
from models.stages.services import ACTOR, call_stage, config_digest, run_service


class FakeActor(Host):
    label = "the actor trainer service"

    def __init__(self, cfg, run, state, info):
        self.calls = []

    @op
    def score(self, state: dict, batch: str):
        self.calls.append((state["iteration"], batch))
        return {"batch": batch, "stats": {"score/n": 1}}


def test_a_resident_service_takes_the_state_and_batch_only_and_refuses_anything_else(tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "the-run-secret")
    cfg = load_config("tiny_grpo", ["run.resident=true", f"run.storage_root={tmp_path}"])
    run = RunHandle(str(tmp_path), "r1", "", "", "", "", launch="local")
    state = PolicyState(3, str(tmp_path / "r1" / "iter-000002" / "actor"))
    host = {}
    monkeypatch.setattr(resident, "host_class", lambda name: lambda *a: host.setdefault(name, FakeActor(*a)))
    out = {}
    thread = threading.Thread(target=lambda: out.update(summary=resident.serve_service(ACTOR, cfg, run, state)),
                              daemon=True)
    thread.start()
    address = book.find(run.layout.url, ACTOR, "local", wait_s=30)
    assert address.launch == "local" and address.url.startswith("http://127.0.0.1:")

    batch = str(tmp_path / "r1" / "iter-000003" / "rollouts.arrow")
    assert call_stage(cfg, run, ACTOR, "score", state, batch) == {"batch": batch, "stats": {"score/n": 1.0}}
    client = run_service(cfg, run, ACTOR)
    args = {"state": dataclasses.asdict(state), "batch": batch}
    refusals = [
        ({**args, "cfg": {"run": {"num_iterations": 1}}}, client, r"422: Refused: .*takes no argument 'cfg'"),
        ({**args, "batch": str(tmp_path / "elsewhere.arrow")}, client, r"403: Refused: batch .* is outside"),
        ({**args, "state": {**args["state"], "actor_url": "s3://other/actor"}}, client,
         r"403: Refused: state.actor_url 's3://other/actor' is outside"),
        (args, ServiceClient(address.url, client.token, digest=config_digest(load_config("tiny_ppo", []))),
         r"409: Refused: .*serves the config it started with"),
        (args, ServiceClient(address.url, "wrong", digest=client.digest), r"401: Unauthorized"),
    ]
    for bad, caller, message in refusals:
        with pytest.raises(ServiceError, match=message):
            caller.call("score", bad)
    assert host[ACTOR].calls == [(3, batch)]

    assert resident.stop_services(run) == [ACTOR]
    thread.join(10)
    assert out["summary"].name == ACTOR and out["summary"].stopped == "the run finished"
    assert book.read(run.layout.url, ACTOR) is None


def test_where_a_cluster_service_listens():
    """On the pod's address (the one it publishes), never on every interface."""
    assert resident.cluster_addresses({"RLHF_SERVICE_HOST": "127.0.0.1"}) == ("127.0.0.1", "127.0.0.1")
    listen, advertise = resident.cluster_addresses({})
    assert listen == advertise == socket.gethostbyname(socket.gethostname()) and listen != "0.0.0.0"


class FakeEngine(Host):
    """The engine service's door to the weight channel: its ``connect`` op opens the channel's receiving end."""

    label = "the engine service"

    def __init__(self, cfg, run, state, info):
        from models.hosts.transports import CollectiveTransport

        self.transport = CollectiveTransport(timeout_s=10)

    @op
    def connect(self, host: str, gpu: str = "", timeout_s=None):
        return self.transport.connect(host=host, gpu=gpu, timeout_s=timeout_s)


@pytest.mark.integration  # waits out a stranger's 2 s on the weight channel
def test_the_doors_of_a_resident_service_open_only_to_the_holder_of_the_run_s_secret(tmp_path, monkeypatch):
    """From outside: no token, a wrong one, another launch's, any string read from the run's folder (the address
    book holds the address only), and a stranger on the weight channel's port without the key the ``connect`` op
    gives the token holder: each refused. The holder of the secret calls and joins."""
    import datetime as dt

    import torch.distributed as dist

    from models.engines.weight_channel import Sender
    from models.stages.services import ENGINE

    monkeypatch.setenv(SECRET_ENV, "the-run-secret")
    cfg = load_config("tiny_grpo", ["run.resident=true", f"run.storage_root={tmp_path}"])
    run = RunHandle(str(tmp_path), "r1", "", "", "", "", launch="local")
    monkeypatch.setattr(resident, "host_class", lambda name: FakeEngine)
    thread = threading.Thread(target=resident.serve_service, args=(ENGINE, cfg, run, PolicyState(0, "")), daemon=True)
    thread.start()
    address = book.find(run.layout.url, ENGINE, "local", wait_s=30)
    holder = run_service(cfg, run, ENGINE)
    found = [str(v) for path in (tmp_path / "r1").rglob("*") if path.is_file()
             for v in json.loads(path.read_text()).values()]  # every value of every file of the run's folder
    assert holder.token not in "\n".join(p.read_text() for p in (tmp_path / "r1").rglob("*") if p.is_file())
    offer = {"host": "127.0.0.1"}
    for token in [None, "wrong", service_token(run.layout.url, "exec-other", ENGINE)] + found:
        with pytest.raises(ServiceError, match=r"connect returned 401: Unauthorized") as err:
            ServiceClient(address.url, token, digest=holder.digest).call("connect", offer)
        assert err.value.status == 401

    channel = holder.call("connect", offer)  # the holder's channel: its port, backend and key
    store = dist.TCPStore("127.0.0.1", channel["port"], None, False, dt.timedelta(seconds=5))
    with pytest.raises(Exception, match=r"(?i)timeout|timed out"):  # a stranger on the port, guessing the key
        dist.ProcessGroupGloo(dist.PrefixStore("weights/0123456789abcdef/", store), 0, 2, dt.timedelta(seconds=2))
    sender = Sender("127.0.0.1", channel, timeout_s=10)  # the holder joins the channel it was given
    sender.close()
    assert resident.stop_services(run) == [ENGINE]
    thread.join(10)
