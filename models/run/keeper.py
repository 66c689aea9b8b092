"""A process's keeper (:mod:`models.run.keeper_process`), started once per process that runs a local run's tasks
(``pyflyte run``: :func:`models.run.end.hold_if_local`) or launches elastic workers (``tasks/elastic.py``), and
what that process tells it: the run it holds, the memory limit, and ``done`` when it ends on its own. The keeper's
report is read through :func:`models.processes.read_report`."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Dict

from models import processes

REPO = str(Path(__file__).resolve().parents[2])
STARTUP_S = 10.0
"""How long a process waits for its keeper's first report (its interpreter's start) before it goes on."""
_started: Dict[int, "Keeper"] = {}


class Keeper:
    """A keeper started for this process (:func:`keeper`): tell it the run, the limit, and ``done`` at exit."""

    def __init__(self):
        self.report_path = os.path.join(tempfile.gettempdir(), f"flyte-rlhf-keeper-{os.getpid()}-"
                                                               f"{uuid.uuid4().hex[:8]}.json")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "models.run.keeper_process", str(os.getpid()),
                                      self.report_path], stdin=subprocess.PIPE, text=True, env=env)
        processes.use_report(self.report_path)
        atexit.register(self.done)
        deadline = time.monotonic() + STARTUP_S
        while not os.path.exists(self.report_path) and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)

    def say(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):  # the keeper is gone: the run goes on without it
            pass

    def hold(self, run) -> None:
        """The run this process holds (a :class:`models.run.end.LiveRun`): ended by the keeper if it dies."""
        self.say("run " + json.dumps({"root": run.root, "name": run.name, "mlflow_run_id": run.mlflow_run_id,
                                      "owner": run.owner}))

    def limit(self, limit_gib: float) -> None:
        if limit_gib > 0:
            self.say(f"limit {int(limit_gib * processes.GIB)} run.memory_limit_gib={limit_gib:g}")

    def done(self) -> None:
        """This process ends on its own: its exit handlers have run."""
        self.say("done")
        try:
            self.proc.stdin.close()
        except OSError:
            pass


def keeper() -> Keeper:
    """This process's keeper, started on the first call."""
    if os.getpid() not in _started:
        _started[os.getpid()] = Keeper()
    return _started[os.getpid()]


def note_task(name: str) -> None:
    """Tell this process's keeper, if it has one, that task ``name`` starts (named if this process is killed)."""
    started = _started.get(os.getpid())
    if started is not None:
        started.say(f"task {name}")
