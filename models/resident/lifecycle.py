"""Starting and stopping a resident run's services (``run.resident``), torch-free.

Locally, where ``pyflyte run`` executes the workflow's nodes one at a time in its own process, the
services run as child processes of that process: started by ``prepare_run`` once the run is laid out
(or resumed), each from the state the run resumes at; stopped by ``finish_run``, by the workflow's
failure handler, and when the process exits. A service also stops by itself when the process that
started it is gone or after ``run.resident_idle_timeout_s`` without a request, so none outlives its run.

The actor and the critic run as ``actor.nproc_per_node`` (``critic.nproc_per_node``) ranks of a
``torchrun`` launch when that is above 1.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

from models import storage
from models.resident import protocol
from models.resident.server import STOP
from models.server.launch import end_process

_RUNNING: Dict[str, List[Tuple[str, subprocess.Popen, Path]]] = {}
"""Services this process started, per run folder URL: ``(name, process, log path)``."""


def needed(cfg) -> List[str]:
    """The services a resident run of ``cfg`` keeps: the engine, the actor, and the critic for PPO."""
    return [protocol.ENGINE, protocol.ACTOR] + ([protocol.CRITIC] if cfg.uses_critic else [])


def _command(cfg, name: str, launch_file: str) -> List[str]:
    nproc = {protocol.ACTOR: cfg.actor.nproc_per_node, protocol.CRITIC: cfg.critic.nproc_per_node}.get(name, 1)
    module = ["-m", "models.resident", name, "--launch", launch_file]
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *module]
    return [sys.executable, *module]


def _environment() -> Dict[str, str]:
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
    return env


def start_services(cfg, run, state, launch: str, timeout_s: float = 600.0) -> List[protocol.ServiceAddress]:
    """Start the run's services from ``state`` and wait until each has published its address (for this
    ``launch``). A service that exits first fails the start with its log's tail; the others are stopped."""
    stop_services(run.layout)  # a previous launch's, if this process still holds any
    token = secrets.token_urlsafe(32)
    folder = Path(tempfile.mkdtemp(prefix=f"resident-{run.run_name}-"))
    launch_file = folder / "launch.json"
    fd = os.open(launch_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({**protocol.request_args(cfg, run, state), "token": token, "launch": launch,
                   "idle_timeout_s": cfg.run.resident_idle_timeout_s, "parent_pid": os.getpid()}, f)
    for name in protocol.SERVICES:
        protocol.unpublish(run.layout, name)
    procs = []
    for name in needed(cfg):
        log_path = folder / f"{name}.log"
        with open(log_path, "w") as log:
            procs.append((name, subprocess.Popen(_command(cfg, name, str(launch_file)), stdout=log,
                                                 stderr=subprocess.STDOUT, env=_environment()), log_path))
    _RUNNING[run.layout.url] = procs
    try:
        return [_wait_ready(run.layout, name, proc, log_path, launch, timeout_s) for name, proc, log_path in procs]
    except BaseException:
        stop_services(run.layout)
        raise


def _wait_ready(layout, name: str, proc: subprocess.Popen, log_path: Path, launch: str,
                timeout_s: float) -> protocol.ServiceAddress:
    deadline = time.monotonic() + timeout_s
    url = protocol.address_url(layout, name)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise protocol.ServiceGone(f"{protocol.SERVICE_LABELS[name]} exited with code {proc.returncode} while "
                                       f"starting; its log ({log_path}) ends:\n{log_tail(log_path)}")
        if storage.exists(url):
            address = protocol.ServiceAddress(**storage.read_json(url))
            if address.launch == launch:
                return address
        time.sleep(0.2)
    raise protocol.ServiceGone(f"{protocol.SERVICE_LABELS[name]} did not get ready in {timeout_s:g} s; its log "
                               f"({log_path}) ends:\n{log_tail(log_path)}")


def log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def stop_services(layout, timeout_s: float = 30.0, launch: str = "") -> List[str]:
    """Stop the services this process started for the run at ``layout`` (``stop`` op, then SIGTERM, then
    SIGKILL) and remove their addresses; with ``launch``, also those of that launch that other processes run
    (on a cluster, the service nodes: each ends once stopped). Returns the names stopped."""
    procs = _RUNNING.pop(layout.url, [])
    stopped = [name for name, _, _ in procs]
    for name, proc, _ in procs:
        if proc.poll() is None:
            try:
                protocol.call(protocol.find(layout, name), STOP, {"reason": "the run ended"}, timeout_s=10)
            except protocol.ServiceError:
                pass
    deadline = time.monotonic() + timeout_s
    for name, proc, _ in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            end_process(proc, 5.0)
        protocol.unpublish(layout, name)
    if launch:
        stopped += stop_published(layout, launch, [name for name, _, _ in procs])
    if procs:
        storage.remove(protocol.services_url(layout), recursive=True)
    return stopped


def stop_published(layout, launch: str, skip=()) -> List[str]:
    """Send ``stop`` to each service of ``launch`` published under the run (but those in ``skip``) and remove
    its address; one that does not answer is gone already (its idle timeout, or its node failed)."""
    stopped = []
    for name in protocol.SERVICES:
        url = protocol.address_url(layout, name)
        if name in skip or not storage.exists(url):
            continue
        address = protocol.ServiceAddress(**storage.read_json(url))
        if address.launch != launch:
            continue
        try:
            protocol.call(address, STOP, {"reason": "the run finished"}, timeout_s=60)
        except protocol.ServiceError:
            pass
        protocol.unpublish(layout, name)
        stopped.append(name)
    return stopped


def running(layout) -> List[Tuple[str, subprocess.Popen, Path]]:
    """The services this process started for the run at ``layout`` (tests, the harness)."""
    return list(_RUNNING.get(layout.url, []))


@atexit.register
def stop_all_services() -> None:
    """Stop every service this process started (the workflow's failure handler, and at exit)."""
    for url in list(_RUNNING):
        for _, proc, _ in _RUNNING.pop(url, []):
            end_process(proc)

