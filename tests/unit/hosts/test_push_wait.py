"""A push from a two-rank FSDP2 actor trainer to an engine that takes it late (models/hosts/trainers.py,
``push_weights``): on a GPU the ranks' gathers are NCCL collectives, whose watchdog ends a rank that waits in one
longer than its timeout (10 minutes by default), while rank 0 waits for the engine to take the push (an off-policy
rollout or an asynchronous unit first: minutes). No rank may enter a collective of the push before rank 0 knows the
engine took it. Here the ranks are gloo with a 2 s collective timeout and the engine takes the push 5 s late (it is
generating: ``RLHF_FAULT_SLOW_ENGINE``, models/faults.py): the push completes, and the engine holds the trainer's
weights. Before the fix rank 1 entered the gathers at once and gloo's timeout ended the push."""

from __future__ import annotations

import datetime as dt
import os
import threading
from types import SimpleNamespace

import pytest
import torch

from models.faults import SLOW_ENGINE_ENV, slow_engine
from models.hosts.transports import CollectiveTransport
from models.service.client import ServiceClient
from models.service.ops import Host, op
from models.service.server import Server, Settings
from tests.processes import free_port
from tests.ranks import spawn
from tests.unit.hosts.test_transports import DictEngine
from tests.unit.models.test_sharded_update import policy

pytestmark = pytest.mark.slow  # two spawned ranks

COLLECTIVE_TIMEOUT_S, ENGINE_LATE_S = 2.0, 5.0


class LateEngine(Host):
    """An engine service busy generating for ``ENGINE_LATE_S`` before it takes the push (the fault hook's sleep)."""

    label = "the engine service"

    def __init__(self, engine: DictEngine):
        self.transport, self.engine = CollectiveTransport(), engine

    @op
    def connect(self, host: str, gpu: str = "", timeout_s=None):
        return self.transport.connect(host=host, gpu=gpu, timeout_s=timeout_s)

    @op
    def weights(self, version: int, probe, tolerance: float, defer: bool = False, meta=None, body=None):
        slow_engine(1)  # a rollout under way: one prompt of RLHF_FAULT_SLOW_ENGINE seconds
        return {**self.transport.receive(meta or {}, body, self.engine)(self.engine), "version": version}


def _rank(rank: int, port: int, url: str, out_dir: str) -> None:
    import torch.distributed as dist

    from models.hosts import trainers
    from models.hosts.trainers import ActorHost
    from models.training.distributed import DistInfo, waiting_group, wrap_for_training

    torch.set_num_threads(1)
    # the store's own timeout for the ranks to meet (a loaded machine may take longer than the collectives' 2 s)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=dt.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    info = DistInfo(rank, 2, rank, torch.device("cpu"))
    try:
        host = object.__new__(ActorHost)  # what a push uses of the actor trainer service, its model FSDP2-sharded
        host.info, host.vocab, host.run = info, 16, None
        model = policy()
        # the ranks meet before the wrap: it opens their shared-memory collectives (a collective under the 2 s
        # timeout, which a loaded machine's uneven start of two spawned processes can exceed); the push is the test
        dist.monitored_barrier(timeout=dt.timedelta(seconds=120))  # gloo's barrier with a timeout of its own
        host.model = wrap_for_training(model, info, "fsdp2")
        host.cfg = SimpleNamespace(probe_tolerance=1e-3, run=SimpleNamespace(resident_push_wait_s=60.0))
        host.transport, host.waiting = CollectiveTransport(timeout_s=30), waiting_group(90.0)
        host.shadow = None  # run.weight_push=full: the wait is the point, not the delta
        trainers.run_service = lambda cfg, run, name: ServiceClient(url, "tok-en", "the engine service",
                                                                    heartbeat=True)  # the address book's answer
        try:
            out = host.send_weights(1, defer=False)
            result = f"ok {out.get('version', '')}"
        except Exception as err:  # noqa: BLE001 -- the test reads it
            result = f"failed {type(err).__name__}: {err}"
        with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
            f.write(result)
    finally:
        dist.destroy_process_group()


def test_no_rank_waits_in_a_collective_while_the_engine_is_late(tmp_path, monkeypatch):
    monkeypatch.setenv(SLOW_ENGINE_ENV, str(ENGINE_LATE_S))
    torch.manual_seed(1)
    whole = {k[len("lm."):]: v.detach().clone() for k, v in policy().state_dict().items()}
    engine = DictEngine({k: torch.zeros_like(v) for k, v in whole.items()})
    server = Server(LateEngine(engine), Settings("tok-en"))
    threading.Thread(target=server.serve, daemon=True).start()
    try:
        spawn(_rank, (free_port(), server.url, str(tmp_path)))
    finally:
        server.close()
    results = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    assert results == ["ok 1", "ok "], results  # rank 0 has the engine's reply; no rank timed out in a gather
    assert all(torch.equal(engine.state[k], v) for k, v in whole.items() if k in engine.state)
