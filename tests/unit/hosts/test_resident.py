"""A resident service's wiring (models/hosts/resident.py with models/stages/services.py), around a host that holds
no model: it publishes its address for the run handle's launch, a stage is called with the iteration's state and
batch only, and the service refuses a request that carries a config, names a location outside the run's folder or
was sent for another config; ``finish_run``'s stop ends it with its summary."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from models.config.io import load_config
from models.hosts import resident
from models.run.types import PolicyState, RunHandle
from models.service import book
from models.service.client import ServiceClient, ServiceError
from models.service.ops import Host, op
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
        (args, ServiceClient(address.url, address.token, digest=config_digest(load_config("tiny_ppo", []))),
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
    assert resident.cluster_addresses({"RLHF_SERVICE_HOST": "127.0.0.1"}) == ("127.0.0.1", "127.0.0.1")
    assert resident.cluster_addresses({})[0] == "0.0.0.0"
