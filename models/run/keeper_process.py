"""The keeper of a local run: a small process beside the process that runs the tasks (``pyflyte run``, or a
test that launches elastic ranks), which watches that process and everything it started.

- It samples their memory every :data:`models.processes.INTERVAL_S` and writes its report
  (:func:`models.processes.read_report`): what the run's messages say a killed process held.
- With ``run.memory_limit_gib`` set, when the run's processes together hold more, it SIGKILLs the largest
  and says so in its report: the task that ran in it fails naming it, the limit and the memory it reached.
- When the process it keeps ends, it stops every process of the run still running (the vLLM engine core,
  elastic workers and their forkserver, services, reward workers), which would otherwise live on holding
  memory and the terminal.
- If that process ended without its exit handlers (SIGKILL: the kernel's OOM killer, ``kill -9``), nothing
  in it could say so: the keeper prints the line that says what happened (the signal, the memory, the OOM
  killer's evidence), marks the run's MLflow run FAILED and releases its lock, unless another launch has
  taken the run over already (:func:`models.run.end.end`). The run resumes from its last commit.

It ignores SIGINT and SIGHUP (Ctrl-C and a closed terminal reach the run, which ends itself and says
"done" on the keeper's stdin), and imports nothing heavy until the run needs marking.

    python -m models.run.keeper_process <pid> <report path>

Its commands, one a line on stdin: ``run <json>``, ``limit <bytes> <setting>``, ``task <name>``, ``done``.

This module is the keeper's process; :mod:`models.run.keeper` starts it and talks to it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

import psutil

from models import processes
from models.faults import slow_keeper
from models.processes import INTERVAL_S, describe, gib, sweep

DRAIN_S = 10.0
"""How long the keeper waits, once the kept process ended, for the lines it wrote before (the pipe to close)."""


class Watch:
    """The process tree of ``pid``: each process's peak RSS, the tree's peak, the memory limit's kills."""

    def __init__(self, pid: int, report_path: str):
        self.root, self.report_path = psutil.Process(pid), report_path
        self.root_name = describe(self.root).split(" (pid")[0]
        self.seen: Dict[Tuple[int, float], psutil.Process] = {}
        self.peaks: Dict[int, Tuple[str, int]] = {}
        self.tree_peak, self.limit, self.setting, self.task = 0, 0, "", ""
        self.kills: list = []
        self.oom_at_start = processes.oom_kills()
        self._written = 0.0

    def alive(self) -> bool:
        try:
            return self.root.is_running() and self.root.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def others(self) -> list:
        """The run's other processes the keeper has seen (orphans included), itself left out."""
        return [p for p in self.seen.values() if p.pid not in (self.root.pid, os.getpid())]

    def sample(self) -> int:
        """Every process's RSS now (new ones remembered); the tree's sum, its peak and the report kept."""
        try:
            for p in [self.root] + self.root.children(recursive=True):
                self.seen.setdefault((p.pid, p.create_time()), p)
        except psutil.Error:
            pass
        rss: Dict[int, int] = {}
        changed = False
        for p in self.seen.values():
            try:
                if p.pid == os.getpid() or not p.is_running():
                    continue
                rss[p.pid] = p.memory_info().rss
            except psutil.Error:
                continue
            label, peak = self.peaks.get(p.pid, ("", 0))
            if rss[p.pid] > peak:
                self.peaks[p.pid] = (label or describe(p), rss[p.pid])
                changed = True
        tree = sum(rss.values())
        self.tree_peak = max(self.tree_peak, tree)
        if self.limit and tree > self.limit:
            self.kill_largest(rss, tree)
            changed = True
        if changed or time.monotonic() - self._written > 5:
            self.write()
        return tree

    def kill_largest(self, rss: Dict[int, int], tree: int) -> None:
        """SIGKILL the run's largest process (the process kept is one of them), noted in the report."""
        pid = max(rss, key=rss.get)
        label = self.peaks.get(pid, (f"pid {pid}", 0))[0]
        if pid == self.root.pid and self.task:
            label += f", running task {self.task}"
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            return
        self.kills.append({"pid": pid, "label": label, "rss": rss[pid], "tree": tree, "limit": self.limit,
                           "setting": self.setting})
        print(f"[flyte-rlhf] memory watchdog: the run's processes held {gib(tree)}, over {self.setting}: killed "
              f"{label}, which held {gib(rss[pid])}", file=sys.stderr, flush=True)

    def write(self) -> None:
        report = {"watched": self.root.pid, "tree_peak": self.tree_peak, "oom_kills_at_start": self.oom_at_start,
                  "limit": {"bytes": self.limit, "setting": self.setting} if self.limit else None,
                  "kills": self.kills,
                  "processes": {str(pid): {"label": label, "peak": peak} for pid, (label, peak) in self.peaks.items()}}
        tmp = f"{self.report_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, self.report_path)
        self._written = time.monotonic()

    def report(self) -> dict:
        self.write()
        return processes.read_report(self.report_path)


class Commands:
    """What the kept process says on the keeper's stdin: the run it holds, the memory limit, ``done``."""

    def __init__(self, watch: Watch):
        self.watch, self.run, self.done, self.read = watch, None, threading.Event(), threading.Event()
        threading.Thread(target=self._read, daemon=True, name="keeper-stdin").start()

    def _read(self) -> None:
        try:
            slow_keeper()  # tests only: the lines arrive as on a loaded machine
            for line in sys.stdin:
                word, _, rest = line.strip().partition(" ")
                if word == "done":
                    self.done.set()
                elif word == "task":
                    self.watch.task = rest
                elif word == "run":
                    self.run = json.loads(rest)
                elif word == "limit":
                    size, _, setting = rest.partition(" ")
                    self.watch.limit, self.watch.setting = int(size), setting
        finally:
            self.read.set()  # the kept process and everything that held its end of the pipe are gone

    def settled(self, timeout_s: float = DRAIN_S) -> None:
        """Wait until every line the kept process wrote before it ended is read (its end of the pipe closed: a
        loaded machine may start this keeper after the process said ``run`` and died, the line still in the pipe)."""
        self.read.wait(timeout_s)


SETTLE_S = 2.0
"""How long the run's other processes get to end by themselves once it ended (multiprocessing's forkserver and
resource tracker end when their parent's pipe closes, a moment after it) before the rest are stopped as left
behind."""


def settled(procs: List, timeout_s: float = SETTLE_S) -> List:
    """Those of ``procs`` still running after up to ``timeout_s`` (each that ends meanwhile is let go)."""
    try:
        return psutil.wait_procs(list(procs), timeout=timeout_s)[1]
    except psutil.Error:
        return list(procs)


def keep(pid: int, report_path: str) -> None:
    """The keeper's life: sample until the kept process ends, then stop what is left of the run; if it ended
    without saying ``done``, say how it ended and end its run (:func:`lost`)."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    watch = Watch(pid, report_path)
    said = Commands(watch)
    watch.sample()
    watch.write()  # the kept process waits for this report: from now on it is watched
    while watch.alive():
        time.sleep(INTERVAL_S)
        watch.sample()
    left = sweep(settled(watch.others()))
    said.settled()
    if said.done.is_set():
        if left:
            print(f"[flyte-rlhf] stopped {len(left)} process(es) the run left behind: {', '.join(left)}",
                  file=sys.stderr, flush=True)
    else:
        print(lost(watch, said.run, left), file=sys.stderr, flush=True)
    try:
        os.remove(report_path)
    except OSError:
        pass


def lost(watch: Watch, run: Optional[dict], left: list) -> str:
    """The line for a kept process that ended without its exit handlers (so by SIGKILL, or a crash); with a
    ``run`` (:class:`models.run.end.LiveRun`'s fields) still held by it, the run marked FAILED and let go."""
    report = watch.report()
    what = f"the run's process {watch.root_name}" if run else f"the process {watch.root_name}"
    note = processes.death_note(watch.root.pid, signal.SIGKILL, what, report)
    note = note.replace(" was killed by SIGKILL", " ended without running its exit handlers: killed by SIGKILL", 1)
    if watch.task:
        note += f"; the last task it started: {watch.task}"
    stopped = f"; stopped {len(left)} process(es) it left behind: {', '.join(left)}" if left else ""
    if run is None:
        return f"[flyte-rlhf] {note}{stopped}"
    from models.run import end as run_end, lock as run_lock

    live = run_end.LiveRun(**run)
    lease = run_lock.lease(live.layout.lock_url)
    if lease is None or lease.owner != live.owner or lease.released_at:  # a relaunch holds the run now
        return f"[flyte-rlhf] run {live.name}: {note}{stopped}; another launch has taken the run over since"
    return run_end.end(live, run_end.FAILED, f"failed: {note}{stopped}")


if __name__ == "__main__":
    keep(int(sys.argv[1]), sys.argv[2])
