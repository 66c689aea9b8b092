"""How a process killed by a signal is described (models/processes.py): who sent it, told from the run's keeper's
report and the kernel's counters, and the memory it held."""

from __future__ import annotations

import signal

from models import processes


def _report(tree_peak: int, oom_start, kills=(), peaks=None) -> dict:
    return {"oom_kills_at_start": oom_start, "tree_peak": tree_peak, "kills": list(kills),
            "processes": {str(pid): {"label": "x", "peak": peak} for pid, peak in (peaks or {}).items()}}


def test_who_sent_a_sigkill():
    """The kernel's OOM killer when its counter rose or the run's processes were within 15% of the limit; the
    memory watchdog when it says so; neither otherwise. Another signal is named alone."""
    limit, _ = processes.memory_limit()
    now = processes.oom_kills()
    assert processes.why_killed(1, 9, _report(int(0.9 * limit), now)).startswith(
        "was killed by SIGKILL, likely by the kernel's OOM killer (the run's processes held ")
    assert processes.why_killed(1, 9, _report(int(0.1 * limit), now)) == (
        "was killed by SIGKILL (no sign of the kernel's OOM killer: /proc/vmstat oom_kill unchanged)")
    assert "likely by the kernel's OOM killer (/proc/vmstat oom_kill rose by 2 while the run ran)" in \
        processes.why_killed(1, 9, _report(0, now - 2))
    kill = {"pid": 7, "label": "rank", "rss": 3 << 30, "tree": 9 << 30, "limit": 8 << 30,
            "setting": "run.memory_limit_gib=8"}
    assert processes.why_killed(7, 9, _report(0, now, [kill])) == (
        "was killed by SIGKILL from the run's memory watchdog: the run's processes held 9.00 GiB, over "
        "run.memory_limit_gib=8")
    assert processes.why_killed(1, signal.SIGSEGV, _report(0, now)) == "was killed by SIGSEGV"


def test_the_memory_of_a_killed_process():
    limit, whose = processes.memory_limit()
    note = processes.death_note(7, 9, "rank 1's process", _report(3 << 30, processes.oom_kills(), peaks={7: 1 << 30}))
    assert note.startswith("rank 1's process (pid 7) was killed by SIGKILL")
    assert note.endswith(f"; its peak memory was 1.00 GiB (RSS, sampled every 0.5 s), the run's processes together "
                         f"3.00 GiB of {whose} {processes.gib(limit)}")
    assert "its memory was never sampled" in processes.death_note(8, 9, "p", _report(0, 0, peaks={7: 1}))
    assert processes.memory_summary("", {}) == ""  # no keeper, nothing said


def test_a_forkserver_starts_under_a_temporary_folder_too_long_for_its_socket(tmp_path):
    """``$TMPDIR`` deeper than a Unix socket's path allows (a test's, a pod's work folder): the forkserver listens
    under /tmp instead, and a worker forked from it runs (before: "OSError: AF_UNIX path too long")."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    deep = tmp_path / ("d" * (processes.AF_UNIX_PATH_MAX - len(str(tmp_path))))
    deep.mkdir()
    script = tmp_path / "fork.py"
    script.write_text(
        "import multiprocessing, sys\n"
        "from models.processes import start_forkserver\n"
        "def work():\n    print('worker ran')\n"
        "if __name__ == '__main__':\n"
        "    start_forkserver([])\n"
        "    from multiprocessing import util\n"
        "    print('folder', util.get_temp_dir())\n"
        "    p = multiprocessing.get_context('forkserver').Process(target=work)\n"
        "    p.start(); p.join(); sys.exit(p.exitcode)\n")
    root = str(Path(processes.__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TMPDIR": str(deep), "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "worker ran" in out.stdout and "folder /tmp/pymp-" in out.stdout, out.stdout
