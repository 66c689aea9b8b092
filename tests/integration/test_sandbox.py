"""The Python tool's sandbox contains what untrusted code does: no network, no writes outside its
scratch folder, fork bombs stopped at the process limit, infinite loops and sleeps killed at the
wall-clock limit, memory capped; and each is reported in what the model reads back."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest

from models.sandbox import SandboxUnavailable, run_python

pytestmark = [pytest.mark.integration,  # each test starts a sandboxed interpreter
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap missing: `make sandbox`")]


def test_code_runs_and_prints():
    r = run_python("print(6 * 7)")
    assert (r.returncode, r.stdout, r.timed_out) == (0, "42\n", False)
    assert r.observation() == "42\n"


def test_no_network():
    r = run_python("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\nprint('connected')")
    assert r.returncode == 1 and "connected" not in r.stdout
    assert "Network is unreachable" in r.stderr and "exit code 1" in r.observation()


def host_folder_outside_tmp() -> str:
    """A host folder the sandbox sees (read-only) rather than its own scratch ``/tmp``: the tests' folder,
    or ``/var/tmp`` where the checkout itself lies under ``/tmp``."""
    here = os.path.realpath(os.path.dirname(__file__))
    return "/var/tmp" if here == "/tmp" or here.startswith("/tmp/") else here


def test_writes_outside_the_scratch_folder_fail():
    with tempfile.TemporaryDirectory(dir=host_folder_outside_tmp()) as host:
        os.chmod(host, 0o777)  # even a folder the sandbox user could write to on the host
        target = os.path.join(host, "escaped.txt")
        r = run_python(f"open({target!r}, 'w').write('x')")
        assert r.returncode == 1 and "Read-only file system" in r.stderr
        assert not os.path.exists(target)
    ok = run_python("open('/tmp/note.txt', 'w').write('kept'); print(open('/tmp/note.txt').read())")
    assert ok.stdout == "kept\n"


def test_a_fork_bomb_hits_the_process_limit():
    code = ("import os, time\nn = 0\ntry:\n    while n < 5000:\n        if os.fork() == 0:\n"
            "            time.sleep(2); os._exit(0)\n        n += 1\n"
            "except OSError as e:\n    print('stopped', n, e)\n")
    r = run_python(code, wall_s=10, max_procs=16)
    assert r.stdout.startswith("stopped") and "Resource temporarily unavailable" in r.stdout
    assert int(r.stdout.split()[1]) < 16


@pytest.mark.parametrize("code", ["while True: pass", "import time; time.sleep(60)"], ids=["loop", "sleep"])
def test_infinite_loops_and_sleeps_are_killed(code):
    t0 = time.monotonic()
    r = run_python(code, wall_s=2)
    assert time.monotonic() - t0 < 10
    assert r.timed_out and r.returncode < 0
    assert "wall-clock limit" in r.observation()


def test_memory_is_capped():
    r = run_python("x = bytearray(2 * 1024 ** 3)", memory_mb=128)
    assert r.returncode == 1 and "MemoryError" in r.stderr


def test_missing_bubblewrap_is_a_clear_error_never_an_unsandboxed_run(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    marker = tmp_path / "ran"
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        run_python(f"open({str(marker)!r}, 'w')")
    assert not marker.exists()
