"""How a run ends when it does not finish: marked FAILED or KILLED in MLflow, its lock released, one
line that says what happened and how to go on. Nothing here ever raises: it runs while a run dies.

Local executions (``pyflyte run`` without ``--remote``) run every task in one process, which holds the
run from ``prepare_run`` to ``finish_run`` (:func:`hold_in_process`): a thread renews the run's lock,
SIGINT/SIGTERM are recorded and stop the run (as ``KeyboardInterrupt``), and at exit a run that did not
finish is marked KILLED (a signal) or FAILED (an error) and its lock released. SIGKILL leaves the run
RUNNING with its lock held; the next launch takes the lock over at once (its holder is gone) and the
MLflow run goes on.

Cluster executions: the training workflows' ``on_failure`` task (:func:`mark_failed`) finds the run by
its Flyte execution id (an MLflow tag) and does the same. An execution aborted from the console runs no
handler: its lock goes stale after ``run.lock_ttl_s``, and a relaunch resumes the run.
"""

from __future__ import annotations

import atexit
import logging
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Dict, Optional

from models import processes
from models.run import keeper as run_keeper, lock as run_lock

from models import tracking
from models.run.errors import root_cause
from models.run.layout import RunLayout
from models.run.resume import next_step

log = logging.getLogger(__name__)

KILLED, FAILED = "KILLED", "FAILED"


@dataclass(frozen=True)
class LiveRun:
    """A run this process holds."""

    root: str
    """``run.storage_root``."""
    name: str
    """The run's folder under it."""
    mlflow_run_id: str
    owner: str
    """Holder of its lock (:func:`models.run.lock.current_owner`)."""

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.root, self.name)


_live: Dict[str, LiveRun] = {}
_beats: Dict[str, run_lock.Heartbeat] = {}
_signals: list = []
_installed = threading.Event()


def hold_if_local(root: str, name: str, mlflow_run_id: str, ttl_s: float, memory_limit_gib: float = 0.0) -> None:
    """In a local execution, this process holds the run until :func:`finished`: heartbeats, signal
    handlers, the exit check, and the run's keeper (:mod:`models.run.keeper`: its memory watched, at most
    ``memory_limit_gib`` when > 0, and the run ended and its processes stopped if this process is killed)
    (``prepare_run`` calls it; a cluster's tasks renew the lock themselves)."""
    owner = run_lock.current_owner()
    if not owner.startswith("local:"):
        return
    run = LiveRun(root, name, mlflow_run_id, owner)
    url = run.layout.url
    if url not in _beats:
        _beats[url] = run_lock.Heartbeat(run.layout.lock_url, owner, max(ttl_s / 4, 1.0))
    _live[url] = run
    keeper = run_keeper.keeper()  # before the exit check is registered: it says "done" after that ran
    keeper.hold(run)
    keeper.limit(memory_limit_gib)
    if not _installed.is_set():
        _installed.set()
        atexit.register(_at_exit)
        install_signal_handlers()


def install_signal_handlers() -> None:
    """SIGINT and SIGTERM stop the run as a ``KeyboardInterrupt`` and are remembered (KILLED at exit).
    Called again after anything that replaced them (torch elastic's launcher does)."""
    if threading.current_thread() is not threading.main_thread() or not _installed.is_set():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)


def _on_signal(signum, frame) -> None:
    name = signal.Signals(signum).name
    note_signal(name)
    raise KeyboardInterrupt(name)


def note_signal(name: str) -> None:
    """Remember a stopping signal that another handler caught (torch elastic's launcher)."""
    if name not in _signals:
        _signals.append(name)


def interrupted_by() -> str:
    """The first stopping signal this process got ("" if none)."""
    return _signals[0] if _signals else ""


def finished(url: str) -> None:
    """``run`` ended normally (``finish_run`` released its lock and closed its MLflow run)."""
    _live.pop(url, None)
    beat = _beats.pop(url, None)
    if beat is not None:
        beat.stop()


def end(run: LiveRun, status: str, why: str) -> str:
    """Mark ``run`` ``status`` in MLflow (with the reason as a tag), release its lock; the line to show."""
    layout = run.layout
    finished(layout.url)
    if status == FAILED:
        why += processes.memory_summary(why)
    try:
        tracking.set_tags(run.mlflow_run_id, {"end_reason": why[:4000]})
        tracking.end_run(run.mlflow_run_id, status)
        marked = f"MLflow run {run.mlflow_run_id} marked {status}"
    except Exception as err:  # noqa: BLE001 - the run is dying: say so, never raise
        marked = f"MLflow run {run.mlflow_run_id} NOT marked {status} ({type(err).__name__}: {err})"
    try:
        released = "lock released" if run_lock.release(layout.lock_url, run.owner) else "lock not held"
    except Exception as err:  # noqa: BLE001
        released = f"lock NOT released ({type(err).__name__}: {err})"
    try:
        state = layout.read_state()
        done = "no iteration committed yet" if state is None else \
            f"iterations up to iter-{state.iteration:06d} committed (state.json)"
    except Exception:  # noqa: BLE001
        done = "state.json unreadable"
    return f"[flyte-rlhf] run {run.name} {why}: {marked}, {released}, {done}; {next_step(why)}"


def _at_exit() -> None:
    sig = interrupted_by()
    for run in list(_live.values()):
        why = f"interrupted by {sig}" if sig else "failed (the error is above)"
        print(end(run, KILLED if sig else FAILED, why), file=sys.stderr, flush=True)


def mark_failed(mlflow_experiment: str, message: str, execution=None) -> Optional[str]:
    """The training workflows' failure handler: this process's live runs (local), else the RUNNING MLflow
    run tagged with this Flyte execution (``execution``: its id, default the current one,
    :func:`models.run.lock.current_execution`; cluster),
    marked FAILED with ``message``; the line that says so, if any."""
    why = f"failed: {root_cause(message)}"
    if _live:
        return "\n".join(end(run, KILLED if interrupted_by() else FAILED, why) for run in list(_live.values()))
    try:
        ex = execution or run_lock.current_execution()
        run = _run_of(mlflow_experiment, ex) if run_lock.on_cluster(ex) else None
    except Exception as err:  # noqa: BLE001 - never raise from a failure handler
        log.warning("failure handler: no run found for this execution: %s", err)
        return None
    return None if run is None else end(run, FAILED, why)


def _run_of(experiment: str, ex) -> Optional[LiveRun]:
    """The RUNNING MLflow run whose ``flyte_execution_id`` tag is execution ``ex`` (prepare_run sets it)."""
    c = tracking.client()
    exp = c.get_experiment_by_name(experiment)
    found = [] if exp is None else c.search_runs(
        [exp.experiment_id], f"tags.flyte_execution_id = '{ex.name}' AND attributes.status = 'RUNNING'", max_results=1)
    if not found:
        return None
    root, name = found[0].data.tags["storage"].rsplit("/", 1)
    return LiveRun(root, name, found[0].info.run_id, run_lock.execution_owner(ex))
