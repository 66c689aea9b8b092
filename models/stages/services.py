"""Which service a stage or a resident run's task calls, through the one client of :mod:`models.service` (torch-free:
the thin tasks import it): a run's own (``run.resident``: ``engine``, ``actor``, ``critic``, found in its address
book under the launch its handle names, on a cluster waiting up to ``run.resident_start_timeout_s``; called with
the digest of the run's config and only what changes, the state and batch URIs), or a server someone else started
(``critic.remote_url``, ``reward.remote_url``, ``rollout.remote_url``: ``RLHF_SERVER_TOKEN``, retries).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from models.config import TrainConfig
from models.config.io import to_dict
from models.run.types import PolicyState, RunHandle
from models.service import book
from models.service.client import ServiceClient, server_token
from models.service.ops import digest

ENGINE, ACTOR, CRITIC = "engine", "actor", "critic"
SERVICES = (ENGINE, ACTOR, CRITIC)
LABELS = {ENGINE: "the engine service", ACTOR: "the actor trainer service", CRITIC: "the critic trainer service"}
LOCAL = "local"
"""The launch of a local run (``models.run.lock.execution_name``): its services start before its first task."""
GONE_HINT = "It was killed or crashed; rerun the launch to resume from the last checkpoint (run.save_interval)"


def config_digest(cfg: TrainConfig) -> str:
    return digest(to_dict(cfg))


def run_service(cfg: TrainConfig, run: RunHandle, name: str) -> ServiceClient:
    """A client of the run's service ``name`` (of the launch ``run`` names)."""
    wait_s = 0.0 if run.launch_name == LOCAL else cfg.run.resident_start_timeout_s
    address = book.find(run.layout.url, name, run.launch_name, wait_s, LABELS[name])
    return ServiceClient(address.url, address.token, LABELS[name], config_digest(cfg), gone_hint=GONE_HINT)


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
    """A resident run's stage ``op`` on its service ``name``: the state (and the batch) it is for."""
    args = {"state": dataclasses.asdict(state), **({"batch": batch} if batch is not None else {}), **extra}
    out = run_service(cfg, run, name).call(op, args)
    if isinstance(out, dict) and "stats" in out:  # JSON keeps 2.0 as 2.0 but a service's count may be an int
        out["stats"] = {k: float(v) for k, v in out["stats"].items()}
    return out
