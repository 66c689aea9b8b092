"""The processes of a run: how much memory they held, how one of them ended, and none left behind.

A local run's keeper (:mod:`models.run.keeper_process`) samples the resident memory (RSS) of the run's process tree
every :data:`INTERVAL_S` and keeps a report (:func:`read_report`): each process's peak, the tree's peak (the
sum of RSS, shared pages counted in every process that maps them, so an upper bound), and the processes it
killed over ``run.memory_limit_gib``. From it and the kernel's own counters :func:`death_note` says how a
process killed by a signal ended::

    rank 1 of the actor update (pid 4121) was killed by SIGKILL, likely by the kernel's OOM killer
    (/proc/vmstat oom_kill rose by 1 while the run ran); its peak memory was 5.20 GiB (RSS, sampled), the
    run's processes together 22.91 GiB of the machine's 23.44 GiB

:func:`sweep` stops processes (SIGTERM, then SIGKILL), :func:`die_with_parent` makes a child die with the
process that started it (``PR_SET_PDEATHSIG``). Linux only where it reads ``/proc``; elsewhere each fact is
left out, never guessed.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import tempfile
from typing import Iterable, List, Optional, Sequence, Tuple

GIB = float(1 << 30)
INTERVAL_S = 0.5
"""How often the keeper samples the run's processes (a process dying sooner after a peak shows less)."""
NEAR_LIMIT = 0.85
"""A tree holding this share of the memory it may hold is near the limit: a SIGKILL then is likely the kernel's
OOM killer's."""
PR_SET_PDEATHSIG = 1
_report_path = ""


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9 (or -9, a return code); ``signal 99`` for one without a name."""
    try:
        return signal.Signals(abs(signum)).name
    except ValueError:
        return f"signal {abs(signum)}"


FORKSERVER = "forkserver"
"""The start method of workers forked from one process that imported what they need (local elastic tasks, a local
resident run's trainer ranks)."""


def start_forkserver(preload: Sequence[str]) -> None:
    """Start this process's forkserver (once) with ``preload`` imported in it: call it while this process has no
    thread of its own yet, or before a launcher starts its threads."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.get_context(FORKSERVER).set_forkserver_preload(list(preload))
    _short_socket_dir()
    forkserver.ensure_running()


AF_UNIX_PATH_MAX = 107
"""The longest path of a Unix socket (``sun_path``'s 108 bytes, its NUL included)."""


def _short_socket_dir() -> None:
    """The forkserver listens on a Unix socket in multiprocessing's temporary folder (``$TMPDIR/pymp-XXXXXXXX/
    listener-XXXXXXXX``): where ``$TMPDIR`` is too long for one (a test's, a pod's deep work folder), that folder goes
    under ``/tmp`` instead of failing with "AF_UNIX path too long"."""
    import multiprocessing
    import shutil
    from multiprocessing import util

    config = multiprocessing.current_process()._config
    if config.get("tempdir") or len(tempfile.gettempdir()) + len("/pymp-XXXXXXXX/listener-XXXXXXXX") <= \
            AF_UNIX_PATH_MAX or not os.path.isdir("/tmp"):
        return
    folder = tempfile.mkdtemp(prefix="pymp-", dir="/tmp")
    util.Finalize(None, shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True}, exitpriority=-100)
    config["tempdir"] = folder


def die_with_parent(signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``signum`` to this process when its parent ends (``prctl(PR_SET_PDEATHSIG)``);
    False where it cannot (not Linux). The parent is the *thread* that started this process: call it only in a
    process started by a main thread that lives as long as its process (a forkserver's, a service's)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the parent ended before the call: nobody will signal
        os.kill(os.getpid(), signum)
    return True


def oom_kills() -> Optional[int]:
    """The kernel's count of processes its OOM killer killed since boot (``/proc/vmstat``), None if unknown."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def kernel_oom_line(pid: int) -> str:
    """The kernel log's line that says its OOM killer killed ``pid`` ("" when unreadable, as it is without
    ``CAP_SYSLOG`` where ``kernel.dmesg_restrict`` is set, or absent)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return ""
    found = ""
    try:
        while True:
            try:
                record = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError:  # EPIPE: a record overwritten while read; go on with the next
                continue
            if not record:
                break
            text = record.split(";", 1)[-1].strip()
            if f"Killed process {pid} " in text or f"Killed process {pid}," in text:
                found = text
    finally:
        os.close(fd)
    return found


def _cgroup_limit() -> Optional[int]:
    """This process's cgroup memory limit in bytes (v2 ``memory.max``, v1 ``memory.limit_in_bytes``)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.strip().split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in (parts for parts in lines if len(parts) == 3):
        if controllers == "":  # cgroup v2
            file = f"/sys/fs/cgroup{path.rstrip('/')}/memory.max"
        elif "memory" in controllers.split(","):  # v1
            file = f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.limit_in_bytes"
        else:
            continue
        try:
            with open(file) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value.isdigit():
            return int(value)
    return None


def memory_limit() -> Tuple[int, str]:
    """``(bytes, whose)``: what the run's processes may hold before the kernel's OOM killer acts: the machine's
    memory, or the cgroup's limit when lower."""
    import psutil

    total = psutil.virtual_memory().total
    limit = _cgroup_limit()
    return (limit, "the cgroup's limit of") if limit is not None and limit < total else (total, "the machine's")


def sweep(procs: Iterable, grace_s: float = 3.0) -> List[str]:
    """Stop the ``psutil.Process`` es of ``procs`` still running (a pid reused since is left alone): SIGTERM,
    SIGKILL after ``grace_s``; the description of each one that was running."""
    import psutil

    alive = [p for p in procs if _running(p)]
    names = [describe(p) for p in alive]
    for p in alive:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, rest = psutil.wait_procs(alive, timeout=grace_s)
    for p in rest:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(rest, timeout=5)
    return names


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def describe(p) -> str:
    """``VLLM::EngineCore (pid 12)``; a Python process by what it runs: ``python -m models.rewards.workers``."""
    import psutil

    try:
        name, cmd = p.name(), p.cmdline()
    except psutil.Error:
        return f"pid {p.pid}"
    if name.startswith("python") and len(cmd) > 1:
        words = [w for i, w in enumerate(cmd[1:], 1) if not (w.startswith("-") and w not in ("-c", "-m"))
                 or cmd[i - 1] in ("-c", "-m")]  # without the interpreter's flags (-B, -u, ...)
        name = " ".join(" ".join(["python"] + words[:2]).split())[:70]
    return f"{name} (pid {p.pid})"


# --- the keeper's report, read by the process it keeps ------------------------------------------

def use_report(path: str) -> None:
    """Read the keeper's report from ``path`` (:mod:`models.run.keeper` sets it when it starts)."""
    global _report_path
    _report_path = path


def read_report(path: str = "") -> dict:
    """The keeper's report (``{}`` without a keeper): ``processes`` ({pid: {"label", "peak"}}), ``tree_peak``,
    ``limit`` ({"bytes", "setting"} or None), ``kills`` (its verdicts), ``oom_kills_at_start``."""
    try:
        with open(path or _report_path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def why_killed(pid: int, signum: int, report: dict) -> str:
    """Who sent ``signum`` to ``pid``, as far as can be told: the run's memory watchdog, the kernel's OOM
    killer (its log, its counter, or a tree near its limit), or no sign of either."""
    name = signal_name(signum)
    for kill in report.get("kills", []):
        if kill["pid"] == pid:
            return (f"was killed by {name} from the run's memory watchdog: the run's processes held "
                    f"{gib(kill['tree'])}, over {kill['setting']}")
    if abs(signum) != signal.SIGKILL:
        return f"was killed by {name}"
    line = kernel_oom_line(pid)
    if line:
        return f"was killed by SIGKILL from the kernel's OOM killer (kernel log: {line[:200]})"
    evidence = oom_evidence(report)
    if evidence:
        return f"was killed by SIGKILL, likely by the kernel's OOM killer ({evidence})"
    return "was killed by SIGKILL (no sign of the kernel's OOM killer: /proc/vmstat oom_kill unchanged)" \
        if report.get("oom_kills_at_start") is not None else "was killed by SIGKILL"


def oom_evidence(report: dict) -> str:
    """Why the kernel's OOM killer likely acted while the run ran ("" without a sign)."""
    start, now = report.get("oom_kills_at_start"), oom_kills()
    if start is not None and now is not None and now > start:
        return f"/proc/vmstat oom_kill rose by {now - start} while the run ran"
    limit, whose = memory_limit()
    peak = report.get("tree_peak", 0)
    if peak >= NEAR_LIMIT * limit:
        return f"the run's processes held {gib(peak)} of {whose} {gib(limit)}"
    return ""


def memory_note(pid: int, report: dict) -> str:
    """``its peak memory was 5.20 GiB (RSS, sampled), the run's processes together 22.91 GiB of the machine's
    23.44 GiB``; "" without a report."""
    if not report:
        return ""
    seen = report.get("processes", {}).get(str(pid))
    limit, whose = memory_limit()
    own = f"its peak memory was {gib(seen['peak'])} (RSS, sampled every {INTERVAL_S:g} s)" if seen else \
        "its memory was never sampled (it lived less than a sample's interval)"
    return f"{own}, the run's processes together {gib(report.get('tree_peak', 0))} of {whose} {gib(limit)}"


def death_note(pid: int, signum: int, what: str, report: Optional[dict] = None) -> str:
    """``what`` (pid ``pid``) was killed by ``signum``: by whom, and the memory it and the run held."""
    report = read_report() if report is None else report
    memory = memory_note(pid, report)
    return f"{what} (pid {pid}) {why_killed(pid, signum, report)}" + (f"; {memory}" if memory else "")


def memory_summary(said: str = "", report: Optional[dict] = None) -> str:
    """`` (memory: ...)`` for a failed run's line: the memory watchdog's kills and the kernel's OOM killer's
    evidence, those ``said`` does not tell already; "" without either (or without a keeper)."""
    report = read_report() if report is None else report
    if not report:
        return ""
    parts = [f"the memory watchdog killed {k['label']}, which held {gib(k['rss'])}, when the run's processes held "
             f"{gib(k['tree'])}, over {k['setting']}" for k in report.get("kills", []) if "memory watchdog" not in said]
    evidence = "" if "OOM killer" in said else oom_evidence(report)
    if evidence:
        parts.append(f"the kernel's OOM killer likely acted: {evidence}")
    return f" (memory: {'; '.join(parts)}; the run's processes peaked at {gib(report.get('tree_peak', 0))})" \
        if parts else ""
