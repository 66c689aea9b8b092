"""Peak resident memory of a process and everything it starts, sampled (psutil).

The memory a run needs on a machine is that of its whole process tree at once: the launching
``pyflyte``, torch-elastic's agent and ranks, vLLM's engine process, reward workers, services. A
thread sums the RSS of the tree every ``interval_s`` and keeps the peak and what made it up. RSS counts a
page shared by two processes twice (forked children share their parent's pages until written), so the
sum is an upper bound of what the tree takes from the machine, the figure the kernel's OOM killer
and a pod's memory limit see per process. Every ``pss_every`` samples it also sums the tree's PSS
(proportional set size, ``/proc/PID/smaps_rollup``: a page shared by n processes counts 1/n in each), what the
tree takes from the machine's memory, without the double count; reading it walks each process's page tables
(a few ms a GiB), hence less often.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import psutil

GIB = 1 << 30


class Peak(NamedTuple):
    """The largest sum seen and the processes that made it up."""

    rss: int
    """Bytes: the sum of the tree's RSS at the peak (of its PSS, for :attr:`TreeSampler.peak_pss`)."""
    at_s: float
    """Seconds since sampling started."""
    parts: List[Tuple[int, str, int]]
    """``(pid, name, rss)`` of each process at the peak, largest first."""

    def describe(self, top: int = 6) -> str:
        return ", ".join(f"{name}[{pid}] {rss / GIB:.2f}" for pid, name, rss in self.parts[:top])


def _label(p: psutil.Process) -> str:
    """A short name: the script or module a Python process runs, else its executable's name."""
    try:
        cmd = p.cmdline()
    except (psutil.Error, OSError):
        return "?"
    if not cmd:
        return "?"
    for i, arg in enumerate(cmd[1:], 1):
        if arg == "-m" and i + 1 < len(cmd):
            return cmd[i + 1].rsplit(".", 1)[-1]
        if arg == "-c":
            return "python -c"
        if not arg.startswith("-"):
            return arg.rsplit("/", 1)[-1][:40]
    return cmd[0].rsplit("/", 1)[-1]


def _tree(pid: int, measure: Callable[[psutil.Process], int]) -> Tuple[int, List[Tuple[int, str, int]]]:
    """The sum of ``measure`` over ``pid`` and its descendants, and each one's ``(pid, name, bytes)``."""
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0, []
    parts = []
    for p in procs:
        try:
            parts.append((p.pid, _label(p), measure(p)))
        except (psutil.Error, AttributeError):  # (gone meanwhile; or a platform whose psutil has no PSS)
            continue
    return sum(r for _, _, r in parts), sorted(parts, key=lambda x: -x[2])


def tree_rss(pid: int) -> Tuple[int, List[Tuple[int, str, int]]]:
    """The RSS sum of ``pid`` and its descendants, and each one's ``(pid, name, rss)``."""
    return _tree(pid, lambda p: p.memory_info().rss)


def tree_pss(pid: int) -> Tuple[int, List[Tuple[int, str, int]]]:
    """:func:`tree_rss` with each process's PSS (what it takes from the machine, shared pages divided among their
    sharers)."""
    return _tree(pid, lambda p: p.memory_full_info().pss)


class TreeSampler:
    """``with TreeSampler(pid) as s: ...``; then ``s.peak`` (RSS, every sample) and ``s.peak_pss`` (PSS, every
    ``pss_every`` samples; none with ``pss_every=0``). Samples from a daemon thread."""

    def __init__(self, pid: int, interval_s: float = 0.2, pss_every: int = 5) -> None:
        self.pid, self.interval_s, self.pss_every = pid, interval_s, pss_every
        self.peak = Peak(0, 0.0, [])
        self.peak_pss = Peak(0, 0.0, [])
        self.series: List[Tuple[float, int, Dict[str, int]]] = []
        """``(seconds, total, {name[pid]: rss})`` of every sample."""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._t0 = 0.0

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            total, parts = tree_rss(self.pid)
            t = time.monotonic() - self._t0
            self.series.append((t, total, {f"{name}[{pid}]": rss for pid, name, rss in parts}))
            if total > self.peak.rss:
                self.peak = Peak(total, t, parts)
            if self.pss_every and n % self.pss_every == 0:
                pss, parts = tree_pss(self.pid)
                if pss > self.peak_pss.rss:
                    self.peak_pss = Peak(pss, time.monotonic() - self._t0, parts)
            n += 1
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "TreeSampler":
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="tree-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    def by_name(self) -> Dict[str, int]:
        """The peak's RSS grouped by process name."""
        out: Dict[str, int] = {}
        for _, name, rss in self.peak.parts:
            out[name] = out.get(name, 0) + rss
        return out
