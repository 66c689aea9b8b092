"""One resident service's life in its process, the same on every rank of a trainer service: build the
host from the run's state, listen on rank 0 and publish the address with the token, serve until stopped,
close. The local child processes (``python -m models.resident``) and the cluster's service tasks
(``tasks/services.py``) both run :func:`serve_service`.

Where a service listens: locally on 127.0.0.1. In a cluster pod on every interface, published as the pod's
own address (``RLHF_SERVICE_HOST`` names one address to listen on and publish instead: the pod harness
sets 127.0.0.1, so its services stay on loopback).
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from models.resident import protocol
from models.stages.outputs import ServiceSummary

SERVICE_HOST_ENV = "RLHF_SERVICE_HOST"


@dataclass(frozen=True)
class ServiceLaunch:
    """How one service of a run is started: by whom (``launch``), with which token, when it stops by itself."""

    name: str
    token: str
    """"": a fresh one (a cluster's service: published with its address, which only the run's storage holds)."""
    launch: str
    """The launch it belongs to (the execution's name on a cluster, ``local`` locally): the run's tasks
    call only a service of their own launch."""
    idle_timeout_s: float
    parent_pid: int = 0
    """Stop when this process is gone (the local ``pyflyte run``); 0: no such watch (a cluster pod)."""
    host: str = "127.0.0.1"
    advertise: str = ""


def cluster_addresses(environ=os.environ) -> Tuple[str, str]:
    """``(listen, advertise)`` of a service in a cluster pod (see the module docstring)."""
    named = environ.get(SERVICE_HOST_ENV, "")
    if named:
        return named, named
    return "0.0.0.0", socket.gethostbyname(socket.gethostname())


def cluster_launch(name: str, cfg, launch: str, environ=os.environ) -> ServiceLaunch:
    """How a service node of a cluster execution ``launch`` starts: a fresh token, the pod's address, the run's
    idle timeout (no launching process to watch)."""
    listen, advertise = cluster_addresses(environ)
    return ServiceLaunch(name, "", launch, cfg.run.resident_idle_timeout_s, 0, listen, advertise)


def stderr_log(name: str) -> Callable[[str], None]:
    def log(line: str) -> None:
        print(f"[{name} service] {line}", file=sys.stderr, flush=True)

    return log


def serve_service(launch: ServiceLaunch, cfg, run, state, log: Optional[Callable[[str], None]] = None) \
        -> ServiceSummary:
    """Hold the service ``launch.name`` of the run from ``state`` and serve its ops until it is stopped (the
    ``stop`` op, the idle timeout, or its launching process gone); rank 0's summary (the other ranks' too)."""
    from models.resident.hosts import HOSTS
    from models.resident.server import RankFanout, ServiceServer, serve
    from models.training.distributed import init_distributed, shutdown_distributed

    log = log or stderr_log(launch.name)
    # the other services it calls (the actor trainer calls the critic's and the engine's): of its own launch, waited
    # for as the tasks wait (on a cluster they start side by side)
    protocol.expect_launch(launch.launch, cfg.run.resident_start_timeout_s)
    info = init_distributed()
    fanout = RankFanout()
    host = HOSTS[launch.name](cfg, run, state, info)
    server = None
    if info.is_main:
        token = launch.token or secrets.token_urlsafe(32)
        server = ServiceServer(token, host=launch.host, idle_timeout_s=launch.idle_timeout_s,
                               parent_pid=launch.parent_pid, advertise=launch.advertise)
        protocol.publish(run.layout, protocol.ServiceAddress(
            launch.name, server.url, token, os.getpid(), launch.launch,
            dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")))
        log(f"ready on {server.url} at iteration {state.iteration}")
    t0 = time.monotonic()
    reason = serve(server, fanout, host.handle, log)
    log(f"stopping: {reason}")
    requests = server.requests if server is not None else 0
    if server is not None:
        server.close()
    close = getattr(getattr(host, "engine", None), "close", None)
    if close is not None:
        close()
    shutdown_distributed()
    return ServiceSummary(launch.name, requests, round(time.monotonic() - t0, 3), reason)
