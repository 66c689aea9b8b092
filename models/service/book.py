"""The address book of a run's services, in the run's folder (every task of the run finds them, on any node,
across the Flyte executions of one launch): ``{run}/services/{name}.json``, published once a service listens. A
caller asks for the service of its own launch (its run handle's), waiting while the services start beside the
first tasks; an earlier launch's address is never used. The book holds addresses, never a token: whoever reads
the bucket learns where a service listens, not how to call it (:mod:`models.service.token`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import List, Sequence

from models import storage
from models.service.client import ServiceClient, ServiceError, ServiceGone
from models.service.token import service_token


@dataclass(frozen=True)
class ServiceAddress:
    """Where a service listens."""

    name: str
    url: str
    pid: int = 0
    launch: str = ""
    """Which launch of the run started it; a relaunch starts fresh services."""
    started_at: str = ""


def services_url(run_url: str) -> str:
    return storage.join(run_url, "services")


def address_url(run_url: str, name: str) -> str:
    return storage.join(services_url(run_url), f"{name}.json")


def publish(run_url: str, address: ServiceAddress) -> None:
    storage.write_json(address_url(run_url, address.name), dataclasses.asdict(address))


def unpublish(run_url: str, name: str) -> None:
    storage.remove(address_url(run_url, name))


def read(run_url: str, name: str) -> "ServiceAddress | None":
    try:  # one read, no exists() first: a service may unpublish between the two
        data = storage.read_json(address_url(run_url, name))
    except FileNotFoundError:
        return None
    fields = {f.name for f in dataclasses.fields(ServiceAddress)}
    return ServiceAddress(**{k: v for k, v in data.items() if k in fields})


def find(run_url: str, name: str, launch: str, wait_s: float = 0.0, label: str = "") -> ServiceAddress:
    """The address service ``name`` of ``launch`` published under the run, waiting up to ``wait_s`` for it;
    :class:`~models.service.client.ServiceGone` when there is none."""
    label, deadline = label or f"service {name!r}", time.monotonic() + wait_s
    while True:
        address = read(run_url, name)
        if address is not None and address.launch == launch:
            return address
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if address is not None:
        raise ServiceGone(f"{label} of the run at {run_url} belongs to launch {address.launch!r}, not to this one "
                          f"({launch!r}), and none of this launch published an address in {wait_s:g} s "
                          f"(run.resident_start_timeout_s)")
    raise ServiceGone(f"{label} of the run at {run_url} has not published an address "
                      f"({address_url(run_url, name)}): the run's services are not running (run.resident=true starts "
                      f"them when the run is launched; rerun the launch to resume)")


def stop_published(run_url: str, launch: str, names: Sequence[str], reason: str) -> List[str]:
    """Send ``stop`` to each service of ``names`` that ``launch`` published under the run and remove its address;
    one that does not answer is gone already (its idle timeout, or its node failed). The names stopped."""
    stopped = []
    for name in names:
        address = read(run_url, name)
        if address is None or address.launch != launch:
            continue
        try:
            token = service_token(run_url, launch, name)
            ServiceClient(address.url, token, timeout_s=60).call("stop", {"reason": reason})
        except ServiceError:
            pass
        unpublish(run_url, name)
        stopped.append(name)
    return stopped
