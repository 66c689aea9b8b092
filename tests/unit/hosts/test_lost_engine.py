"""No lost iteration when the engine service is lost (#38): the actor trainer's version moves only once the engine
confirmed the new weights, and the same update again sends the weights it trained instead of stepping twice
(:class:`~models.hosts.trainers.ActorHost`, its heavy parts stubbed); a stage on a restarted engine is run again
once the trainer gave it the weights it holds, or the engine loaded the state's committed actor
(:func:`~models.stages.services.call_stage`, over real services in this process holding fakes)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from models.config.io import load_config
from models.hosts import resident, trainers
from models.hosts.engine import WrongIteration
from models.hosts.trainers import ActorHost, PushFailed
from models.run.types import PolicyState, RunHandle
from models.service import book
from models.service.client import ServiceError
from models.service.ops import Host, op
from models.service.token import SECRET_ENV
from models.stages.outputs import UpdateOutput
from models.stages.services import ACTOR, ENGINE, call_stage, run_service
from models.training.distributed import DistInfo


class Weights:
    """The transport's sending end: the first push fails as when the engine is killed under it."""

    def __init__(self):
        self.versions = []

    def ready(self, engine, args, weights, wait_s=None, plan=None):
        pass

    def send(self, engine, args, lm, weights, plan=None, shadow=None):
        self.versions.append(args["version"])
        if len(self.versions) == 1:
            raise ServiceError("the engine service at http://127.0.0.1:9 does not answer (weights: connection reset)")
        return {"resident/weights_bytes": 8.0}


def actor_host(monkeypatch, steps) -> ActorHost:
    host = object.__new__(ActorHost)  # the trainer's state without its models
    host.cfg, host.run = load_config("tiny_grpo"), RunHandle("/tmp/runs", "r", "", "", "", "", launch="local")
    host.info, host.label, host.version = DistInfo(0, 1, 0, torch.device("cpu")), "the actor trainer service", 3
    host.last = host.trained = host.waiting = host.shadow = None  # run.weight_push=full: no shadow
    host.model, host.vocab, host.transport, host.trainee = torch.nn.Module(), 16, Weights(), None
    host.model.lm = torch.nn.Linear(2, 2)
    monkeypatch.setattr(trainers, "update_trainee",
                        lambda *a, **k: steps.append(a[3].iteration) or UpdateOutput("", {"actor/loss": 0.5}))
    monkeypatch.setattr(trainers, "reference_logprobs", lambda model, vocab: ([[1, 2]], [[-0.5]]))
    monkeypatch.setattr(trainers, "run_service", lambda *a: "the engine's client")
    return host


def test_the_actor_moves_on_only_once_the_engine_confirmed_the_update_s_weights(monkeypatch):
    steps = []
    host = actor_host(monkeypatch, steps)
    state = dataclasses.asdict(PolicyState(3, "/tmp/runs/r/iter-000002/actor"))
    with pytest.raises(PushFailed, match=r"does not answer .*\(the trainer keeps the weights"):
        host.update(state, "/tmp/runs/r/iter-000003/advantages.arrow")
    assert host.version == 3 and steps == [3]
    with pytest.raises(WrongIteration, match=r"holds the update of iteration 3, which the engine did not confirm"):
        host.held(3)  # no score, push or other update meanwhile: the trainer holds iteration 4's weights
    out = host.update(state, "/tmp/runs/r/iter-000003/advantages.arrow")  # the same request again: sent again
    assert steps == [3] and host.transport.versions == [4, 4] and host.version == 4
    assert out["stats"]["actor/loss"] == 0.5 and out["stats"]["resident/weights_bytes"] == 8.0
    assert host.update(state, "/tmp/runs/r/iter-000003/advantages.arrow") == out  # its reply lost: the same result
    assert host.push(4)["resident/weights_bytes"] == 8.0 and host.transport.versions == [4, 4, 4]  # a new engine's
    with pytest.raises(WrongIteration):
        host.push(3)


class FakeEngine(Host):
    label = "the engine service"

    def __init__(self, version: int, committed=()):
        self.version, self.committed, self.loads = version, set(committed), []

    @op
    def rollout(self, state: dict, ahead: int = 0):
        if state["iteration"] != self.version:
            raise WrongIteration(f"the engine service holds the policy of iteration {self.version}")
        return {"batch": f"{state['actor_url']}/../rollouts.arrow", "stats": {"rollout/n": 1}}

    @op
    def weights(self, version: int):
        self.version = version
        return {}

    @op
    def load(self, state: dict):
        if state["actor_url"] not in self.committed:
            raise WrongIteration("not a committed checkpoint")
        self.loads.append(state["iteration"])
        self.version = state["iteration"]
        return {}


class FakeActor(Host):
    """Holds the weights of iteration ``version`` and pushes them to the engine service it finds."""

    label = "the actor trainer service"
    statuses = {WrongIteration: 409}

    def __init__(self, cfg, run, version: int):
        self.cfg, self.run, self.version, self.pushes = cfg, run, version, []

    @op
    def push(self, iteration: int):
        if iteration != self.version:
            raise WrongIteration(f"the actor trainer service holds the policy of iteration {self.version}")
        self.pushes.append(iteration)
        return run_service(self.cfg, self.run, ENGINE).call("weights", {"version": iteration})


FakeEngine.statuses = {WrongIteration: 409}


def serve(name: str, host: Host, cfg, run, monkeypatch) -> threading.Thread:
    monkeypatch.setattr(resident, "host_class", lambda _: lambda *a: host)
    thread = threading.Thread(target=resident.serve_service, args=(name, cfg, run, PolicyState(0, "")), daemon=True)
    thread.start()
    book.find(run.layout.url, name, "local", wait_s=30)
    return thread


@pytest.mark.integration  # waits for a restarted engine (about 1.5 s)
def test_a_stage_outlives_a_restarted_engine(tmp_path, monkeypatch):
    """The engine killed (its address left, nothing listening) and started again from the run's start: the rollout
    asked meanwhile waits for it, has the actor trainer push the weights it holds, and runs; for an actor the
    trainer no longer holds, the engine loads the state's committed checkpoint."""
    monkeypatch.setenv(SECRET_ENV, "the-run-secret")
    cfg = load_config("tiny_grpo", ["run.resident=true", f"run.storage_root={tmp_path}",
                                    "run.resident_start_timeout_s=30"])
    run = RunHandle(str(tmp_path), "r1", "", "", "", "", launch="local")
    state = PolicyState(2, str(tmp_path / "r1" / "iter-000001" / "actor"))
    actor, first = FakeActor(cfg, run, 2), FakeEngine(2)
    serve(ACTOR, actor, cfg, run, monkeypatch)
    serve(ENGINE, first, cfg, run, monkeypatch)
    assert call_stage(cfg, run, ENGINE, "rollout", state)["stats"] == {"rollout/n": 1.0}
    dead = book.read(run.layout.url, ENGINE)
    run_service(cfg, run, ENGINE).call("stop", {"reason": "killed"})  # its address stays: as after a SIGKILL
    second = FakeEngine(0, committed=[str(tmp_path / "r1" / "iter-000000" / "actor")])
    restart = threading.Timer(0.5, serve, (ENGINE, second, cfg, run, monkeypatch))
    restart.start()
    assert call_stage(cfg, run, ENGINE, "rollout", state)["batch"].endswith("rollouts.arrow")
    restart.join()
    assert book.read(run.layout.url, ENGINE).url != dead.url and actor.pushes == [2] and second.version == 2
    older = PolicyState(1, str(tmp_path / "r1" / "iter-000000" / "actor"))  # off-policy: one iteration behind
    assert call_stage(cfg, run, ENGINE, "rollout", older)["stats"] == {"rollout/n": 1.0}
    assert second.loads == [1] and actor.pushes == [2]
    gone = PolicyState(3, str(tmp_path / "r1" / "uncommitted" / "actor"))  # held by no one, committed nowhere
    with pytest.raises(ServiceError, match=r"load returned 409: WrongIteration: not a committed checkpoint"):
        call_stage(cfg, run, ENGINE, "rollout", gone)
    resident.stop_services(run)


class Engine:
    """The engine service's client: it holds push ``held`` and says whether it takes deltas."""

    def __init__(self, held: str, patchable: bool):
        self.reply = {"id": held, "patchable": patchable}

    def call(self, name, *args):
        assert name == "held_push"
        return self.reply


@pytest.mark.parametrize("patchable", [True, False])
def test_the_ranks_keep_the_engines_copy_only_for_an_engine_that_takes_deltas(monkeypatch, patchable):
    """``run.weight_push=delta`` with vLLM on CPU (no in-place patch): every push is full, and the ranks' copy of the
    engine's weights (the model's size at the engine's dtype) is not kept for deltas that never come."""
    host = actor_host(monkeypatch, [])
    host.shadow = trainers.Shadow()
    host.shadow.tensors, host.shadow.base = {"lm.weight": torch.zeros(2, 2, dtype=torch.bfloat16)}, "p1"
    sent = []
    host.transport.send = lambda engine, args, lm, source, plan=None, shadow=None: sent.append((plan, shadow)) or {}
    engine = Engine("p1", patchable)
    trainers.push_weights(host.transport, None, lambda: engine, {"version": 4}, None, None, 1.0, host.push_plan,
                          host.shadow)
    (plan, shadow), = sent
    assert plan["base"] == ("p1" if patchable else "") and plan["keep"] is patchable  # a delta against p1, or full
    assert (shadow is host.shadow) is patchable
    assert bool(host.shadow.tensors) is patchable and (host.shadow.base == plan["id"]) is patchable
