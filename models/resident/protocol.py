"""How the tasks of a resident run (``run.resident``) find and call its services, torch-free: a thin
task imports this module and the config, never torch or vLLM.

Each service publishes its address under the run folder::

    {run}/services/{name}.json     {"name", "url", "token", "pid", "launch", "started_at"}

and accepts ``POST {url}/call`` with ``Authorization: Bearer {token}`` and a JSON body
``{"op": ..., "args": {...}}``. The reply is ``{"result": ...}``, or ``{"error": ..., "kind": ...}``
with status 500 (the service's own error, its message naming the cause) or 401 (wrong token). New
actor weights travel as ``POST {url}/weights``: JSON arguments and the packed tensors in one binary body
(:func:`post_weights`), or as a ``weights`` op whose tensors come over a collective
(:mod:`models.resident.channel`, ``run.resident_weight_transport``).

Names: ``engine`` (the generation engine: rollout and evaluation), ``actor`` (the actor trainer: π_old
and π_ref, the update, the actor's checkpoints), ``critic`` (PPO: values, the update, its checkpoints).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from models import storage
from models.run.layout import RunLayout

ENGINE, ACTOR, CRITIC = "engine", "actor", "critic"
SERVICES = (ENGINE, ACTOR, CRITIC)
SERVICE_LABELS = {ENGINE: "the engine service", ACTOR: "the actor trainer service",
                  CRITIC: "the critic trainer service"}


class ServiceError(RuntimeError):
    """A call to one of the run's services failed; the message names the service."""


class ServiceGone(ServiceError):
    """The service does not answer (killed, crashed, or never started): the iteration fails and a rerun
    resumes from the last checkpoint with fresh services."""


@dataclass(frozen=True)
class ServiceAddress:
    """Where a service listens, with the token it accepts (``{run}/services/{name}.json``)."""

    name: str
    url: str
    token: str = dataclasses.field(repr=False)
    pid: int = 0
    launch: str = ""
    """Which launch of the run started it (its lock's holder); a relaunch starts fresh services."""
    started_at: str = ""

    @property
    def label(self) -> str:
        return SERVICE_LABELS.get(self.name, f"service {self.name!r}")


def services_url(layout: RunLayout) -> str:
    return storage.join(layout.url, "services")


def address_url(layout: RunLayout, name: str) -> str:
    return storage.join(services_url(layout), f"{name}.json")


def publish(layout: RunLayout, address: ServiceAddress) -> None:
    storage.write_json(address_url(layout, address.name), dataclasses.asdict(address))


def unpublish(layout: RunLayout, name: str) -> None:
    storage.remove(address_url(layout, name))


_EXPECTED = {"launch": "", "wait_s": 0.0}
"""The launch this process's calls go to, and how long :func:`find` waits for it (:func:`expect_launch`)."""


def expect_launch(launch: str, wait_s: float = 0.0) -> None:
    """Call only services of ``launch`` from this process, waiting up to ``wait_s`` for one to publish its
    address. On a cluster the services start as nodes beside the iteration's first tasks, which wait for
    them; a stale address of an earlier launch of the run is never used."""
    _EXPECTED.update(launch=launch, wait_s=float(wait_s))


def find(layout: RunLayout, name: str) -> ServiceAddress:
    """The published address of service ``name`` (of the launch :func:`expect_launch` named, waiting for it
    as long as that said); :class:`ServiceGone` when none is published."""
    url, launch = address_url(layout, name), _EXPECTED["launch"]
    deadline = time.monotonic() + _EXPECTED["wait_s"]
    while True:
        address = ServiceAddress(**storage.read_json(url)) if storage.exists(url) else None
        if address is not None and (not launch or address.launch == launch):
            return address
        if time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if address is not None:
        raise ServiceGone(f"{SERVICE_LABELS.get(name, name)} of run {layout.run_name} at {url} belongs to launch "
                          f"{address.launch!r}, not to this one ({launch!r}), and none of this launch published an "
                          f"address in {_EXPECTED['wait_s']:g} s (run.resident_start_timeout_s)")
    raise ServiceGone(f"{SERVICE_LABELS.get(name, name)} of run {layout.run_name} has not published an "
                      f"address ({url}): the run's services are not running (run.resident=true starts them "
                      f"when the run is launched; rerun the launch to resume)")


def post(address: ServiceAddress, path: str, body: bytes, content_type: str, timeout_s: float) -> Any:
    """``POST`` to the service; its JSON ``result``. Errors name the service."""
    req = urllib.request.Request(address.url.rstrip("/") + path, data=body, method="POST",
                                 headers={"Authorization": f"Bearer {address.token}", "Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())["result"]
    except urllib.error.HTTPError as err:
        raise ServiceError(f"{address.label} at {address.url} failed: {_error_text(err)}") from None
    except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as err:
        reason = getattr(err, "reason", err)
        raise ServiceGone(f"{address.label} at {address.url} (pid {address.pid}) does not answer: {reason}. "
                          f"It was killed or crashed; rerun the launch to resume from the last checkpoint "
                          f"(run.save_interval)") from None


def _error_text(err: urllib.error.HTTPError) -> str:
    raw = err.read()
    try:
        body = json.loads(raw)
        return f"{body.get('kind', 'Error')}: {body.get('error', '')}"
    except ValueError:
        return f"HTTP {err.code}: {raw[:300]!r}"


def call(address: ServiceAddress, op: str, args: Mapping[str, Any], timeout_s: float = 3600.0) -> Any:
    """Run ``op`` on the service with JSON ``args``; its JSON result."""
    body = json.dumps({"op": op, "args": dict(args)}).encode()
    return post(address, "/call", body, "application/json", timeout_s)


def post_weights(address: ServiceAddress, args: Mapping[str, Any], blob: bytes, timeout_s: float = 3600.0) -> Any:
    """``POST /weights``: JSON ``args`` then the binary ``blob`` in one body (:func:`split_weights_body`)."""
    head = json.dumps(dict(args)).encode()
    return post(address, "/weights", len(head).to_bytes(8, "big") + head + blob, "application/octet-stream",
                timeout_s)


def split_weights_body(body: bytes) -> Tuple[Dict[str, Any], bytes]:
    n = int.from_bytes(body[:8], "big")
    return json.loads(body[8:8 + n]), body[8 + n:]


def call_service(layout: RunLayout, name: str, op: str, args: Mapping[str, Any],
                 timeout_s: float = 3600.0) -> Any:
    return call(find(layout, name), op, args, timeout_s)


def request_args(cfg, run, state, batch_uri: Optional[str] = None, **extra: Any) -> Dict[str, Any]:
    """The JSON form of a stage's inputs: the config, the run handle, the policy state and a batch URI."""
    from models.config.io import to_dict

    out: Dict[str, Any] = {"cfg": to_dict(cfg), "run": dataclasses.asdict(run), "state": dataclasses.asdict(state)}
    if batch_uri is not None:
        out["batch"] = batch_uri
    out.update(extra)
    return out


def read_args(args: Mapping[str, Any]):
    """``(cfg, run, state)`` of :func:`request_args`' JSON."""
    from models.config.io import config_from_json_dict
    from models.run.types import PolicyState, RunHandle

    return config_from_json_dict(args["cfg"]), RunHandle(**args["run"]), PolicyState(**args["state"])
