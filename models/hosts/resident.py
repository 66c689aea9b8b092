"""A resident run's services (``run.resident``), torch-free until one starts: which a run keeps, one service's life in
its process (:func:`serve_service`: a local child process, or a cluster's service node, ``tasks/services.py``), and
locally their start and stop. Locally they are child processes of ``pyflyte run`` (a trainer as the ranks of a
launch when its ``nproc_per_node`` is above 1: torchrun's, its ranks forked, :mod:`models.hosts.ranks`), listening
on 127.0.0.1: started by ``prepare_run`` from the state the run starts or resumes at, stopped by ``finish_run``, the
failure handler and at the process's exit, or by themselves when it is gone or after ``run.resident_idle_timeout_s``
idle. A local engine service that dies (killed, crashed) while the run holds it is started again
(:data:`ENGINE_RESTARTS` times); its callers then give it the trainer's weights
(:func:`models.stages.services.call_stage`). In a cluster pod a service listens on the pod's address only and
publishes it (``RLHF_SERVICE_HOST`` names another). A trainer launch is never restarted by torch elastic
(``max_restarts=0``): it would come back at the run's start, not where the run is. Every service accepts only its
token, derived from the run's secret (:mod:`models.service.token`): the launch file holds none, the children get the
secret in their environment.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime as dt
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from models import processes, storage
from models.config.io import to_dict
from models.run.types import PolicyState, RunHandle
from models.service import book
from models.service.client import ServiceGone
from models.service.launch import ChildProcess, end_process, serve
from models.service.ranks import RankFanout
from models.service.server import Settings
from models.stages.outputs import ServiceSummary
from models.service.token import ensure_local_secret, service_token
from models.stages.services import ACTOR, CRITIC, ENGINE, LABELS, SERVICES, config_digest

SERVICE_HOST_ENV = "RLHF_SERVICE_HOST"
ENGINE_RESTARTS = 3
"""How often a local run starts its engine service again after it died."""
_RUNNING: Dict[str, List[ChildProcess]] = {}
"""Services this process started, per run folder URL."""


def needed(cfg) -> List[str]:
    """The services a resident run of ``cfg`` keeps: the engine (none colocated: the actor's ranks hold the
    engines), the actor, and the critic for PPO."""
    colocated = cfg.run.resident_layout == "colocated"
    return ([] if colocated else [ENGINE]) + [ACTOR] + ([CRITIC] if cfg.uses_critic else [])


COLOCATED_ACTOR = "colocated-actor"
"""The host of the actor service whose ranks hold the engines too (``run.resident_layout=colocated``)."""


def host_class(name: str):
    """The host class of service ``name`` (imported when a service starts: this module stays torch-free)."""
    from models.hosts.colocated import ColocatedActorHost
    from models.hosts.engine import EngineHost
    from models.hosts.trainers import ActorHost, CriticHost

    return {ENGINE: EngineHost, ACTOR: ActorHost, CRITIC: CriticHost, COLOCATED_ACTOR: ColocatedActorHost}[name]


def serve_service(name: str, cfg, run: RunHandle, state: PolicyState, listen: str = "127.0.0.1",
                  advertise: str = "", parent_pid: int = 0, log: Optional[Callable[[str], None]] = None) \
        -> ServiceSummary:
    """Hold service ``name`` of the run from ``state`` (every rank of a trainer service builds its shard) and serve
    its ops until it is stopped; rank 0 listens and publishes its address once all ranks are ready, accepting only
    the token derived from the run's secret. Rank 0's summary (the other ranks' too)."""
    from models.training.distributed import init_distributed, shutdown_distributed

    log = log or (lambda line: print(f"[{name} service] {line}", file=sys.stderr, flush=True))
    token = service_token(run.layout.url, run.launch_name, name)  # before any model loads: no secret, no service
    info = init_distributed()
    share = RankFanout(cfg.run.resident_rank_grace_s, log)
    colocated = name == ACTOR and cfg.run.resident_layout == "colocated"
    host = host_class(COLOCATED_ACTOR if colocated else name)(cfg, run, state, info)
    settings = Settings(token, run.layout.url, config_digest(cfg), idle_timeout_s=cfg.run.resident_idle_timeout_s,
                        parent_pid=parent_pid)

    def announce(server) -> None:
        started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        book.publish(run.layout.url, book.ServiceAddress(name, server.url, os.getpid(), run.launch_name, started))
        print(f"{LABELS[name]} ready on {server.url} at iteration {state.iteration}", flush=True)

    t0 = time.monotonic()
    reason, requests = serve(host, settings, announce, listen, 0, advertise, info.is_main, share, log)
    log(f"stopping: {reason}")
    host.close()
    shutdown_distributed()
    return ServiceSummary(name, requests, round(time.monotonic() - t0, 3), reason)


def serve_launch(name: str, launch_file: str) -> ServiceSummary:
    """:func:`serve_service` of service ``name`` as the launch file :func:`start_services` wrote describes it."""
    from models.config.io import config_from_json_dict

    with open(launch_file) as f:
        launch = json.load(f)
    return serve_service(name, config_from_json_dict(launch["cfg"]), RunHandle(**launch["run"]),
                         PolicyState(**launch["state"]), parent_pid=int(launch.get("parent_pid", 0)))


def cluster_addresses(environ=os.environ) -> Tuple[str, str]:
    """``(listen, advertise)`` of a service in a cluster pod: the pod's address (its host name's), or the one
    ``RLHF_SERVICE_HOST`` names; never every interface."""
    named = environ.get(SERVICE_HOST_ENV, "") or socket.gethostbyname(socket.gethostname())
    return named, named


def _command(cfg, name: str, launch_file: str) -> List[str]:
    nproc = {ACTOR: cfg.actor.nproc_per_node, CRITIC: cfg.critic.nproc_per_node}.get(name, 1)
    module = ["-m", "models.hosts", name, "--launch", launch_file]
    if nproc > 1:  # torchrun's standalone launch, its ranks forked from one preloaded process
        colocated = ["--colocated"] if name == ACTOR and cfg.run.resident_layout == "colocated" else []
        return [sys.executable, "-m", "models.hosts", "ranks", f"--nproc={nproc}", *colocated, *module[2:]]
    return [sys.executable, *module]


def start_services(cfg, run: RunHandle, state: PolicyState, timeout_s: float = 600.0) -> List[str]:
    """Start the run's services as child processes from ``state`` and wait until each listens (its address
    published for the launch ``run`` names); their URLs. One that exits first fails the start with its log's
    tail; the others are stopped."""
    ensure_local_secret()  # the services' token is derived from it; the children inherit it
    stop_services(run)  # a previous launch's, if this process still holds any
    folder = Path(tempfile.mkdtemp(prefix=f"resident-{run.run_name}-"))
    launch_file = folder / "launch.json"
    fd = os.open(launch_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"cfg": to_dict(cfg), "run": dataclasses.asdict(run), "state": dataclasses.asdict(state),
                   "parent_pid": os.getpid()}, f)
    for name in SERVICES:
        book.unpublish(run.layout.url, name)
    children = [ChildProcess(_command(cfg, name, str(launch_file)), folder / f"{name}.log", LABELS[name]).spawn()
                for name in needed(cfg)]
    _RUNNING[run.layout.url] = children
    try:
        urls = [child.wait_ready(timeout_s) for child in children]
    except BaseException:
        stop_services(run)
        raise
    if ENGINE in needed(cfg):
        engine = children[needed(cfg).index(ENGINE)]
        threading.Thread(target=_supervise, args=(run, engine, timeout_s), daemon=True, name="engine-restarts").start()
    return urls


def _supervise(run: RunHandle, child: ChildProcess, timeout_s: float) -> None:
    """Start the engine service again when it dies while the run holds it (an exit the run did not ask for); when
    it cannot, remove its address, so that its callers fail at once instead of waiting for it."""
    say = lambda line: print(f"[resident] {line}", file=sys.stderr, flush=True)  # noqa: E731
    for restart in range(1, ENGINE_RESTARTS + 2):
        code = child.proc.wait()
        held = _RUNNING.get(run.layout.url, [])
        if child not in held:  # stopped by the run (finish, failure, exit)
            return
        how = f"{child.label} exited (code {code})" if code >= 0 else \
            processes.death_note(child.proc.pid, -code, child.label)  # the signal, its memory
        if restart > ENGINE_RESTARTS:
            say(f"{how}; for the {restart}th time: not started again")
            book.unpublish(run.layout.url, ENGINE)
            return
        say(f"{how}: started again from the run's starting state ({restart} of "
            f"{ENGINE_RESTARTS}); its callers give it the trainer's weights")
        fresh = ChildProcess(child.command, child.log_path.with_name(f"{ENGINE}-{restart}.log"), child.label).spawn()
        held[held.index(child)] = child = fresh
        try:
            child.wait_ready(timeout_s)
        except ServiceGone as err:
            say(str(err))
            book.unpublish(run.layout.url, ENGINE)
            return


def stop_services(run: RunHandle, timeout_s: float = 30.0, finished: bool = False) -> List[str]:
    """Stop the services of the launch ``run`` names (the ``stop`` op, then SIGTERM, then SIGKILL for the child
    processes this process started) and remove their addresses; on a cluster the service nodes each end once
    stopped. ``finished``: the run ended well, so their folder goes too (:func:`_tidy`). Returns the names
    stopped."""
    children = _RUNNING.pop(run.layout.url, [])
    stopped = book.stop_published(run.layout.url, run.launch_name, SERVICES, "the run finished") if run.launch else []
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            child.stop(5.0)
    if children:
        storage.remove(book.services_url(run.layout.url), recursive=True)
        if finished:
            _tidy(children)
    return stopped


def _tidy(children: List[ChildProcess]) -> None:
    """The services' folder (their launch file and logs, under ``$TMPDIR``) removed after a run that finished, unless
    one of them ended other than asked (a non-zero exit), the engine service was started again meanwhile (its
    logs say why) or ``RLHF_VERBOSE`` asks to keep everything; a run that fails keeps it."""
    from models.console import verbose

    folder = children[0].log_path.parent
    restarted = any(folder.glob(f"{ENGINE}-*.log"))
    if verbose() or restarted or any(child.proc.returncode != 0 for child in children):
        return
    shutil.rmtree(folder, ignore_errors=True)


@atexit.register
def stop_all_services() -> None:
    """Stop every service this process started (the workflow's failure handler, and at exit)."""
    for url in list(_RUNNING):
        for child in _RUNNING.pop(url, []):
            end_process(child.proc)
