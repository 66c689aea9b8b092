"""One run per name: a lease on the run folder, ``{run}/lock.json``.

The lease names its holder and when it last proved alive; it is taken, renewed, handed over and
released only by compare-and-swap writes (:mod:`models.storage.cas`: ``If-None-Match``/``If-Match``
PUTs on S3, ``flock`` locally), so of two launches that race for a run exactly one gets it.

Who holds it: the *execution*, not a process. On a Flyte cluster that is the execution id, the same in
every task pod of one run (``flyte:<project>/<domain>/<name>``); in a local ``pyflyte run`` every task
runs in one process, so it is that process (``local:<host>:<pid>:<token>``, the token told apart from
a reused pid by the process's start time).

When it is free: released (``finish_run``, or a failed/killed run), or stale — its last heartbeat is
older than its ``ttl_s`` (``run.lock_ttl_s``), or its holder is a local process on this host that is
gone (a SIGKILLed run is taken over at once, without waiting for the TTL).

Heartbeats: locally a thread of the ``pyflyte`` process renews the lease every ``ttl_s / 4``
(:mod:`models.run.end`); on a cluster the long tasks (updates, commit, evaluation, finish) renew it while
they run (:func:`heartbeat`), so the TTL must exceed the longest gap between them (a rollout and a
score, plus pod start-up).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import socket
import threading
import uuid
from typing import Iterator, NamedTuple, Optional, Tuple

from models.storage.cas import read_versioned, write_if

log = logging.getLogger(__name__)

_PROCESS_TOKEN = uuid.uuid4().hex[:12]


class RunLocked(RuntimeError):
    """Another live launch holds the run."""


class LostLock(RuntimeError):
    """This execution's lease on the run was taken over by another (it was stale)."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _iso(t: dt.datetime) -> str:
    return t.isoformat(timespec="milliseconds")


def _process_started(pid: int) -> float:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def _process_start_ticks(pid: int) -> int:
    """The process's start in clock ticks after boot (field 22 of ``/proc/<pid>/stat``; 0 when there is
    no such process, or no ``/proc``). Unlike psutil's ``create_time``, which adds the boot time read
    afresh from the wall clock (``/proc/stat``'s ``btime``, whole seconds), it does not move when the
    clock is stepped, so a live holder never looks like another process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    return int(stat[stat.rindex(b")") + 2:].split()[19])  # after "pid (comm) ": field 3 onwards


class Execution(NamedTuple):
    """A Flyte execution's id (flytekit's ``WorkflowExecutionIdentifier`` has the same three fields)."""

    project: str
    domain: str
    name: str


def on_cluster(ex) -> bool:
    """Execution ``ex`` runs on a cluster: it is named, and of a domain other than a local run's."""
    return bool(ex.name) and ex.domain not in ("", "local")


_EXECUTION_ENV = ("FLYTE_INTERNAL_EXECUTION_PROJECT", "FLYTE_INTERNAL_EXECUTION_DOMAIN", "FLYTE_INTERNAL_EXECUTION_ID")
"""What Flyte puts in a task pod's environment (``pyflyte-execute`` builds the task's execution id from
it, and the workers an elastic task starts inherit it); a local ``pyflyte run`` sets none of them."""


def current_execution() -> Execution:
    """This process's Flyte execution, read from the environment Flyte gives a task pod (all fields
    empty outside one): the core reads no flytekit context."""
    return Execution(*(os.environ.get(k, "") for k in _EXECUTION_ENV))


def execution_name(owner: str = "") -> str:
    """The Flyte execution's name in holder ``owner`` (default: this execution's) on a cluster (the
    ``flyte_execution_id`` tag the failure handler finds a run by; a resident run's services are published
    under it), else ``local``."""
    owner = owner or current_owner()
    return owner.rsplit("/", 1)[-1] if owner.startswith("flyte:") else "local"


def execution_owner(ex) -> str:
    """The holder name of Flyte execution ``ex`` (an :class:`Execution` or flytekit's
    ``WorkflowExecutionIdentifier``) on a cluster."""
    return f"flyte:{ex.project}/{ex.domain}/{ex.name}"


def current_owner() -> str:
    """This execution's holder name: the Flyte execution on a cluster, else this process."""
    ex = current_execution()
    if on_cluster(ex):
        return execution_owner(ex)
    return f"local:{socket.gethostname()}:{os.getpid()}:{_PROCESS_TOKEN}"


@dataclasses.dataclass(frozen=True)
class Lease:
    """Content of ``lock.json``."""

    owner: str
    """Holder: ``flyte:<project>/<domain>/<execution>`` or ``local:<host>:<pid>:<token>``."""
    host: str
    """Host that took or last renewed it."""
    pid: int
    """Process that took or last renewed it."""
    pid_started: float
    """That process's start time (seconds since the epoch), to tell a reused pid."""
    acquired_at: str
    """When the holder took it (ISO 8601 UTC)."""
    heartbeat_at: str
    """When the holder last proved alive."""
    ttl_s: float
    """The lease is stale this long after ``heartbeat_at``."""
    released_at: str = ""
    """Set when the holder let go: the run is free."""
    pid_start_ticks: int = 0
    """That process's start in clock ticks after boot (Linux), what tells a reused pid; 0 in leases
    written before it or where there is no ``/proc`` (then ``pid_started`` tells)."""

    @classmethod
    def new(cls, owner: str, ttl_s: float, acquired_at: str = "") -> "Lease":
        now, pid = _iso(_now()), os.getpid()
        return cls(owner, socket.gethostname(), pid, _process_started(pid), acquired_at or now, now, ttl_s,
                   pid_start_ticks=_process_start_ticks(pid))

    def age_s(self) -> float:
        return (_now() - dt.datetime.fromisoformat(self.heartbeat_at)).total_seconds()

    def holder_gone(self) -> bool:
        """A local holder on this host whose process is no more (or is another process now)."""
        if not self.owner.startswith("local:") or self.host != socket.gethostname():
            return False
        if self.pid_start_ticks:
            return _process_start_ticks(self.pid) != self.pid_start_ticks
        return abs(_process_started(self.pid) - self.pid_started) > 0.01

    def free_because(self) -> str:
        """Why the lease may be taken ("" when it is held)."""
        if self.released_at:
            return f"released at {self.released_at}"
        if self.holder_gone():
            return f"its holder, process {self.pid} on {self.host}, is gone"
        if self.age_s() > self.ttl_s:
            return f"stale: no heartbeat for {self.age_s():.0f} s > ttl {self.ttl_s:.0f} s"
        return ""

    def describe(self) -> str:
        return (f"{self.owner} (host {self.host}, pid {self.pid}) since {self.acquired_at}, last heartbeat "
                f"{self.heartbeat_at} ({self.age_s():.0f} s ago, stale after {self.ttl_s:.0f} s)")

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True).encode() + b"\n"


def _read(url: str) -> Optional[Tuple[Lease, str]]:
    got = read_versioned(url)
    if got is None:
        return None
    data, version = got
    return Lease(**json.loads(data.decode())), version


def acquire(url: str, ttl_s: float, owner: str = "", attempts: int = 5) -> Lease:
    """Take the lease at ``url`` for ``owner`` (default :func:`current_owner`); the holder itself takes it
    again (a retried or resumed task). :class:`RunLocked` naming the holder if it is live."""
    owner = owner or current_owner()
    for _ in range(attempts):
        cur = _read(url)
        if cur is None:
            lease = Lease.new(owner, ttl_s)
            if write_if(url, lease.encode(), None):
                return lease
            continue
        held, version = cur
        mine = held.owner == owner and not held.released_at
        why = "" if mine else held.free_because()
        if not mine and not why:
            raise RunLocked(f"run {url.rsplit('/', 1)[0]} is held by {held.describe()}: another launch is "
                            f"training it. Wait for it to end, or stop it; a holder that died lets go "
                            f"{held.ttl_s:.0f} s after its last heartbeat (at once for a local process on "
                            f"this host). If you know it is dead, delete {url} and launch again")
        lease = Lease.new(owner, ttl_s, held.acquired_at if mine else "")
        if write_if(url, lease.encode(), version):
            if why:
                log.warning("run lock %s: taking over from %s (%s)", url, held.owner, why)
            return lease
    raise RunLocked(f"run lock {url}: still contended after {attempts} attempts; launch again")


def acquired_at(url: str) -> str:
    """When the launch that holds the run now took it (ISO 8601 UTC; "" without a lease)."""
    cur = _read(url)
    return "" if cur is None else cur[0].acquired_at


def renew(url: str, owner: str = "") -> Lease:
    """A new heartbeat for ``owner``'s lease; :class:`LostLock` if someone else holds the run now."""
    owner = owner or current_owner()
    cur = _read(url)
    if cur is None or cur[0].owner != owner or cur[0].released_at:
        holder = "nobody" if cur is None else cur[0].describe()
        raise LostLock(f"run lock {url}: this execution ({owner}) no longer holds the run; it is held by {holder}. "
                       f"Another launch took it over after this one stopped sending heartbeats: stop here, so "
                       f"two launches never write the same run")
    held, version = cur
    lease = Lease.new(owner, held.ttl_s, held.acquired_at)
    if not write_if(url, lease.encode(), version):
        return renew(url, owner)  # our own concurrent heartbeat won: check again
    return lease


def release(url: str, owner: str = "") -> bool:
    """Let go of ``owner``'s lease (it stays as a released record); False if not held by ``owner``."""
    owner = owner or current_owner()
    for _ in range(3):
        cur = _read(url)
        if cur is None or cur[0].owner != owner or cur[0].released_at:
            return False
        held, version = cur
        if write_if(url, dataclasses.replace(held, released_at=_iso(_now())).encode(), version):
            return True
    return False


class Heartbeat:
    """Renews a lease every ``interval_s`` in a daemon thread until :meth:`stop`; remembers a loss."""

    def __init__(self, url: str, owner: str, interval_s: float):
        self.url, self.owner, self.interval_s = url, owner, interval_s
        self.lost: Optional[LostLock] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"run-lock-heartbeat {url}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                renew(self.url, self.owner)
            except LostLock as err:
                self.lost = err
                log.error("%s", err)
                return
            except Exception as err:  # noqa: BLE001 - storage hiccup: the next beat tries again
                log.warning("run lock %s: heartbeat failed: %s", self.url, err)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@contextlib.contextmanager
def heartbeat(url: str, owner: str = "") -> Iterator[None]:
    """Inside a task of a cluster execution: check that this execution still holds the run, and renew
    the lease while the task runs. Local executions keep theirs from the ``pyflyte`` process instead."""
    owner = owner or current_owner()
    if owner.startswith("local:"):
        yield
        return
    lease = renew(url, owner)
    beat = Heartbeat(url, owner, max(lease.ttl_s / 4, 1.0))
    try:
        yield
    finally:
        beat.stop()
    if beat.lost is not None:
        raise beat.lost


def lease(url: str) -> Optional[Lease]:
    """The lease at ``url`` as it stands (None without one)."""
    cur = _read(url)
    return None if cur is None else cur[0]
