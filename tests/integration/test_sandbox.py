"""The Python tool's sandbox contains what untrusted code does: no network, nothing of the host read but the
interpreter (no secrets, project, home folders), no writes outside its scratch folder, fork bombs stopped at
the process limit, infinite loops and sleeps killed at the wall-clock limit, memory capped; and each is
reported in what the model reads back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from models.environments.sandbox import SandboxUnavailable, run_python
from tasks import secrets

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
    """A host folder outside the sandbox's own scratch ``/tmp``: the tests' folder, or ``/var/tmp``
    where the checkout itself lies under ``/tmp``."""
    here = os.path.realpath(os.path.dirname(__file__))
    return "/var/tmp" if here == "/tmp" or here.startswith("/tmp/") else here


def test_writes_outside_the_scratch_folder_fail():
    with tempfile.TemporaryDirectory(dir=host_folder_outside_tmp()) as host:
        os.chmod(host, 0o777)  # even a folder the sandbox user could write to on the host
        target = os.path.join(host, "escaped.txt")
        r = run_python(f"open({target!r}, 'w').write('x')")
        assert r.returncode == 1 and "No such file or directory" in r.stderr  # the host folder is not there
        assert not os.path.exists(target)
    for target in ("'/escaped.txt'", "os.path.dirname(os.__file__) + '/escaped.py'"):  # new root; standard library
        r = run_python(f"import os\nopen({target}, 'w').write('x')")
        assert r.returncode == 1 and "Read-only file system" in r.stderr, target
    ok = run_python("open('/tmp/note.txt', 'w').write('kept'); print(open('/tmp/note.txt').read())")
    assert ok.stdout == "kept\n"


READ_BACK = ("import sys\nfor path in sys.argv[1:]:\n    try:\n        print(path, 'READ', open(path).read())\n"
             "    except OSError as e:\n        print(path, type(e).__name__)\n")
"""Tries to read each path it is given; sandboxed code's ``sys.argv`` is fixed, so the paths go in the code."""


def read_back(paths) -> str:
    return run_python(READ_BACK.replace("sys.argv[1:]", repr([str(p) for p in paths]))).stdout


def test_nothing_of_the_host_is_readable_a_0644_secret_the_project_or_home(monkeypatch):
    """A Kubernetes secret volume mounts each key world-readable (0644) under Flyte's secrets path; the
    sandbox user could read it, the project checkout and home folders if the host were bound."""
    with tempfile.TemporaryDirectory(dir=host_folder_outside_tmp()) as mount, \
            tempfile.NamedTemporaryFile("w", dir=Path.home(), prefix="sandbox-home-") as home_file:
        monkeypatch.setenv("FLYTE_SECRETS_DEFAULT_DIR", mount)
        from flytekit.core.context_manager import SecretsManager
        key = secrets.S3[1].key
        path = Path(SecretsManager().get_secrets_file(secrets.GROUP, key))
        path.parent.mkdir(parents=True)
        path.write_text("s3-secret-value")
        path.chmod(0o644)
        for folder in (Path(mount), path.parent):
            folder.chmod(0o755)
        assert SecretsManager().get(secrets.GROUP, key) == "s3-secret-value"  # where Flyte reads it
        home_file.write("home-secret"), home_file.flush(), os.chmod(home_file.name, 0o644)
        project_file = Path(__file__).resolve().parents[2] / "pyproject.toml"
        paths = [path, home_file.name, project_file, "/etc/passwd", "/etc/secrets"]
        assert all(Path(p).is_file() and Path(p).stat().st_mode & 0o004 for p in paths[:4])  # world-readable
        out = read_back(paths)
    assert " READ " not in out and "s3-secret-value" not in out and "home-secret" not in out
    assert out.count("FileNotFoundError") == len(paths), out


def test_the_standard_library_works_inside():
    """Modules whose extensions link shared libraries (OpenSSL, zlib, SQLite, libffi, mpdecimal)
    give what the same interpreter gives on the host."""
    code = ("import hashlib, zlib, sqlite3, ctypes, decimal, json, statistics, fractions, datetime\n"
            "db = sqlite3.connect(':memory:')\n"
            "print(hashlib.sha256(b'abc').hexdigest(), zlib.crc32(zlib.compress(b'x' * 99)),\n"
            "      db.execute('select 6 * 7').fetchone()[0], ctypes.sizeof(ctypes.c_long),\n"
            "      decimal.Decimal(1) / decimal.Decimal(7), statistics.mean([1, 2, 4]),\n"
            "      fractions.Fraction(3, 9), datetime.date(2026, 11, 25).isoweekday(), json.dumps({'a': [1]}))\n")
    host = subprocess.run(["/usr/bin/python3", "-I", "-S", "-c", code], capture_output=True, text=True, check=True)
    r = run_python(code)
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout == host.stdout and len(r.stdout.split()) == 10


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
