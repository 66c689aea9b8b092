"""Which service a stage or a resident run's task calls, through the one client of :mod:`models.service` (torch-free:
the thin tasks import it): a run's own (``run.resident``: ``engine``, ``actor``, ``critic``, found in its address
book under the launch its handle names, on a cluster waiting up to ``run.resident_start_timeout_s``; called with
the token derived from the run's secret (:mod:`models.service.token`), the digest of the run's config and only what
changes, the state and batch URIs; a service silent for ``run.resident_answer_timeout_s`` fails the call, naming
it), or a server someone else started (``critic.remote_url``, ``reward.remote_url``, ``rollout.remote_url``:
``RLHF_SERVER_TOKEN``, retries).

A stage on the engine service outlives the engine: when it does not answer (killed; restarted by the run locally,
by its node's retry on a cluster) or holds another policy than the request's, :func:`call_stage` waits for it to
answer again, has the actor trainer send it the weights it holds (or the engine load the state's committed actor)
and runs the stage again; an actor update whose push failed is asked again once the engine answers, and the trainer
sends the weights it already trained (:func:`restore_engine`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Dict, Optional

from models.config import TrainConfig
from models.config.io import to_dict
from models.run.types import PolicyState, RunHandle
from models.service import book
from models.service.client import ServiceClient, ServiceError, ServiceGone, server_token
from models.service.ops import digest
from models.service.token import service_token

log = logging.getLogger(__name__)

ENGINE, ACTOR, CRITIC = "engine", "actor", "critic"
SERVICES = (ENGINE, ACTOR, CRITIC)
LABELS = {ENGINE: "the engine service", ACTOR: "the actor trainer service", CRITIC: "the critic trainer service"}
LOCAL = "local"
"""The launch of a local run (``models.run.lock.execution_name``): its services start before its first task."""
GONE_HINT = "It was killed or crashed; rerun the launch to resume from the last checkpoint (run.save_interval)"
RECOVERIES = 3
"""How often one stage recovers from the engine service's loss (a restarted engine, a push that failed)."""
WRONG_ITERATION, PUSH_FAILED = "WrongIteration", "PushFailed"


def generating_service(cfg: TrainConfig) -> str:
    """The service that runs the rollout and the evaluation: the engine's, or with ``run.resident_layout=colocated``
    the actor trainer's (its ranks hold the engines)."""
    return ACTOR if cfg.run.resident_layout == "colocated" else ENGINE


def config_digest(cfg: TrainConfig) -> str:
    return digest(to_dict(cfg))


def run_service(cfg: TrainConfig, run: RunHandle, name: str, wait_s: Optional[float] = None) -> ServiceClient:
    """A client of the run's service ``name`` (of the launch ``run`` names); ``wait_s``: how long to wait for its
    address (default: none locally, ``run.resident_start_timeout_s`` on a cluster)."""
    if wait_s is None:
        wait_s = 0.0 if run.launch_name == LOCAL else cfg.run.resident_start_timeout_s
    address = book.find(run.layout.url, name, run.launch_name, wait_s, LABELS[name])
    return ServiceClient(address.url, service_token(run.layout.url, run.launch_name, name), LABELS[name],
                         config_digest(cfg), timeout_s=cfg.run.resident_answer_timeout_s, gone_hint=GONE_HINT,
                         heartbeat=True)


def server(url: str, timeout_s: float, label: str) -> ServiceClient:
    """A client of a server someone else started at ``url`` (``python -m models.hosts serve`` or ``serve-rollout``)."""
    return ServiceClient(url, server_token(), label, timeout_s=timeout_s, retries=3)


def critic_service(cfg: TrainConfig, run: RunHandle) -> ServiceClient:
    """Where the critic's values come from when this process holds no critic: ``critic.remote_url``'s server, or
    the run's critic service."""
    if cfg.critic.remote_url:
        return server(cfg.critic.remote_url, cfg.reward.remote_timeout_s, "reward server")
    return run_service(cfg, run, CRITIC)


def call_stage(cfg: TrainConfig, run: RunHandle, name: str, op: str, state: PolicyState,
               batch: Optional[str] = None, **extra: Any) -> Any:
    """A resident run's stage ``op`` on its service ``name``: the state (and the batch) it is for; recovering from
    the engine service's loss (see the module docstring)."""
    args = {"state": dataclasses.asdict(state), **({"batch": batch} if batch is not None else {}), **extra}
    for attempt in range(RECOVERIES + 1):
        try:
            out = run_service(cfg, run, name).call(op, args)
            break
        except ServiceError as err:
            engine_lost = name == ENGINE and (isinstance(err, ServiceGone) or err.kind == WRONG_ITERATION)
            if attempt == RECOVERIES or not (engine_lost or name == ACTOR and err.kind == PUSH_FAILED):
                raise
            log.warning("%s; recovering (%d of %d)", err, attempt + 1, RECOVERIES)
            if generating_service(cfg) == ACTOR:  # colocated: the update's request again loads the weights again
                continue
            await_engine(cfg, run)
            if name == ENGINE:
                restore_engine(cfg, run, state)
    if isinstance(out, dict) and "stats" in out:  # JSON keeps 2.0 as 2.0 but a service's count may be an int
        out["stats"] = {k: float(v) for k, v in out["stats"].items()}
    return out


def await_engine(cfg: TrainConfig, run: RunHandle) -> ServiceClient:
    """The engine service once it answers again (a restarted one publishes its new address), waiting up to
    ``run.resident_start_timeout_s``; locally none when its address is gone (the run removes it when it cannot
    start the engine again)."""
    deadline = time.monotonic() + cfg.run.resident_start_timeout_s
    while True:
        left = 0.0 if run.launch_name == LOCAL else max(deadline - time.monotonic(), 0.0)
        engine = run_service(cfg, run, ENGINE, wait_s=left)  # ServiceGone: no address
        try:
            engine.call("health", timeout_s=min(30.0, cfg.run.resident_answer_timeout_s))
            return engine
        except ServiceGone:  # the dead engine's address: not replaced yet
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def restore_engine(cfg: TrainConfig, run: RunHandle, state: PolicyState) -> Dict[str, float]:
    """A (restarted) engine given the policy of ``state``: the actor trainer sends the weights it holds when they
    are that policy's, else the engine loads the state's committed actor (refused when it is not committed)."""
    try:
        return run_service(cfg, run, ACTOR).call("push", {"iteration": state.iteration})
    except ServiceError as err:
        if err.kind != WRONG_ITERATION:
            raise
        return run_service(cfg, run, ENGINE).call("load", {"state": dataclasses.asdict(state)})
