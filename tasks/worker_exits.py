"""Which elastic worker a signal killed, as a local run's forkserver saw it (``tasks/elastic.py``).

torchrun reports the first failed worker it polls, not the first that failed: a rank SIGKILLed (the kernel's
OOM killer) makes the others fail on the closed connection within milliseconds, and torchrun, polling once a
second, often names one of those ("Connection reset by peer") and never the killed rank. The forkserver
reaps every worker, so it knows: imported there (``PRELOAD``) with :data:`EXITS_ENV` set, this module records
each child it reaps that a signal ended (``exit <pid> <signal>``), and each worker records its rank
(:func:`record_rank`: ``rank <rank> <pid>``), in one file per launching process, read back by
:func:`killed_ranks` when a launch fails. Nothing happens where :data:`EXITS_ENV` is unset.
"""

from __future__ import annotations

import os
import tempfile
from typing import Dict, Tuple

EXITS_ENV = "RLHF_WORKER_EXITS"


def exits_path() -> str:
    """The record of this process's workers (set in its forkserver's environment when it starts)."""
    return os.path.join(tempfile.gettempdir(), f"flyte-rlhf-worker-exits-{os.getpid()}")


def _append(line: str) -> None:
    path = os.environ.get(EXITS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def record_rank() -> None:
    """In a worker: its rank and pid."""
    _append(f"rank {os.environ.get('RANK', '?')} {os.getpid()}")


def _recording(waitpid):
    def waitpid_recorded(pid: int, options: int):
        got = waitpid(pid, options)
        if got[0] > 0 and os.WIFSIGNALED(got[1]):
            _append(f"exit {got[0]} {os.WTERMSIG(got[1])}")
        return got

    waitpid_recorded.recording = True
    return waitpid_recorded


def size() -> int:
    """Where the next launch's records start."""
    try:
        return os.path.getsize(exits_path())
    except OSError:
        return 0


def killed_ranks(since: int = 0) -> Dict[int, Tuple[int, int]]:
    """``{rank: (pid, signal)}`` of the workers a signal killed, recorded after offset ``since``."""
    try:
        with open(exits_path()) as f:
            f.seek(since)
            lines = [line.split() for line in f]
    except OSError:
        return {}
    ranks = {int(pid): int(rank) for kind, rank, pid in (x for x in lines if len(x) == 3) if kind == "rank"
             and rank.isdigit()}
    return {ranks[int(pid)]: (int(pid), int(sig)) for kind, pid, sig in (x for x in lines if len(x) == 3)
            if kind == "exit" and int(pid) in ranks}


if os.environ.get(EXITS_ENV) and not getattr(os.waitpid, "recording", False):
    os.waitpid = _recording(os.waitpid)  # in the forkserver: its main loop reaps the workers with os.waitpid
