"""The run's keeper (models/run/keeper_process.py) on small processes: a child over ``run.memory_limit_gib`` is
killed and named with the memory it reached; a process SIGKILLed (as the kernel's OOM killer does) leaves no child behind,
and the keeper says how it ended, naming what it stopped (not a child that ended by itself a moment after, as
multiprocessing's forkserver does after a run that finished). The whole run is ``test_resume.py``'s (its pyflyte
SIGKILLed mid-update), a rank killed in an update ``test_elastic_faults.py``'s."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PARENT = """
import os, subprocess, sys, time
from models import processes
from models.run.keeper import keeper
keeper().limit(0.25)
hog = subprocess.Popen([sys.executable, "-c", "import time; x = b'1' * (400 << 20); time.sleep(60)"])
code = hog.wait()
time.sleep(1.0)  # the keeper's report written after its kill
print(code, processes.death_note(hog.pid, -code, "task rollout's process"), flush=True)
idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
brief = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2.5)"])  # ends 1 s after the parent
print(idle.pid, flush=True)
time.sleep(1.5)  # sampled by the keeper
os.kill(os.getpid(), 9)  # as the kernel's OOM killer would
"""


def test_a_child_over_the_limit_is_killed_named_and_nothing_outlives_a_killed_parent():
    out = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == -9, out.stderr
    lines = out.stdout.splitlines()
    code, note = lines[0].split(" ", 1)
    assert code == "-9", out.stdout
    # the task, the signal, who sent it, the memory it reached and the limit
    found = re.fullmatch(r"task rollout's process \(pid \d+\) was killed by SIGKILL from the run's memory watchdog: "
                         r"the run's processes held ([\d.]+) GiB, over run.memory_limit_gib=0.25; its peak memory "
                         r"was ([\d.]+) GiB \(RSS, sampled every 0.5 s\), the run's processes together [\d.]+ GiB of "
                         r".* [\d.]+ GiB", note)
    assert found, note
    assert float(found.group(1)) >= 0.25 and 0.2 < float(found.group(2)) <= 0.4, note
    assert "[flyte-rlhf] memory watchdog: the run's processes held" in out.stderr, out.stderr
    idle = int(lines[1])
    # subprocess.run returned once the keeper, which shares the parent's stderr, had ended: after its sweep
    assert not psutil.pid_exists(idle) or psutil.Process(idle).status() == psutil.STATUS_ZOMBIE
    said = [line for line in out.stderr.splitlines() if "ended without running its exit handlers" in line]
    assert len(said) == 1, out.stderr
    assert re.search(r"\[flyte-rlhf\] the process python -c .* \(pid \d+\) ended without running its exit handlers: "
                     r"killed by SIGKILL \(.*\); its peak memory was [\d.]+ GiB .*; stopped 1 process\(es\) it left "
                     rf"behind: python -c import time; time.sleep\(120\) \(pid {idle}\)", said[0]), said[0]



def test_a_service_killed_while_starting_is_named_with_the_signal(tmp_path):
    from models.service.client import ServiceGone
    from models.service.launch import ChildProcess

    child = ChildProcess([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"], tmp_path / "svc.log",
                         "the engine service", timeout_s=60)
    with pytest.raises(ServiceGone) as err:
        child.start()
    assert re.match(r"the engine service died while starting: its process \(pid \d+\) was killed by SIGKILL",
                    str(err.value)), str(err.value)
