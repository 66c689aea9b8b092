"""Python code run in a real sandbox: bubblewrap (Debian's ``bubblewrap``, ``bwrap``).

The child runs in fresh user, PID, network (no interface but loopback: no network), IPC and UTS
namespaces. Of the host it sees only what the interpreter needs, read-only (:func:`interpreter_binds`:
its executable, its standard library and the system's shared libraries), with a fresh ``/dev`` and
``/proc``: nothing of ``/etc`` (Flyte mounts secrets at ``/etc/secrets``), home folders, the project or
the run's storage. It writes only to its own scratch
folder mounted at ``/tmp`` (a new temporary directory per run, deleted afterwards; the host's
``/tmp`` is not visible), and is its own session
(``--new-session``: it cannot inject input into the caller's terminal). Inside, before the code runs,
``setrlimit`` caps CPU time (``RLIMIT_CPU``), address space (``RLIMIT_AS``), the number of processes
(``RLIMIT_NPROC``: fork bombs fail) and file size (``RLIMIT_FSIZE``); outside, a wall-clock limit kills
the whole process group (a ``sleep`` or a blocked read uses no CPU time).

Without ``bwrap`` on the path :func:`run_python` raises :class:`SandboxUnavailable` naming the fix
(``apt-get install -y bubblewrap``, ``make sandbox``): it never runs the code unsandboxed.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from typing import List, Tuple

SANDBOX_PRELUDE = """\
import resource, sys
resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
resource.setrlimit(resource.RLIMIT_AS, ({mem}, {mem}))
resource.setrlimit(resource.RLIMIT_NPROC, ({nproc}, {nproc}))
resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize}, {fsize}))
sys.argv = ["main.py"]
code = open("/tmp/main.py").read()
exec(compile(code, "main.py", "exec"), {{"__name__": "__main__"}})
"""
"""Run by the sandboxed interpreter: the limits first (the code cannot raise them again), then the code."""


NOBODY = 65534
"""The uid/gid the sandbox runs as when the caller is root."""


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here."""


@dataclass
class SandboxResult:
    """What a sandboxed run did: its exit code (negative: killed by that signal), output, and whether
    the wall-clock limit killed it."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool

    def observation(self, limit: int = 2000) -> str:
        """What the model reads back: stdout, then stderr and how the run ended when it failed."""
        if self.timed_out:
            return (self.stdout + "\nerror: the code ran past its wall-clock limit and was killed")[-limit:]
        if self.returncode == 0:
            return self.stdout[-limit:]
        how = f"killed by signal {-self.returncode}" if self.returncode < 0 else f"exit code {self.returncode}"
        return f"{self.stdout}\n{self.stderr}\nerror: {how}"[-limit:]


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable("the Python tool needs bubblewrap (bwrap) and it is not installed: "
                                 "`apt-get install -y bubblewrap` (Debian/Ubuntu) or `make sandbox`; "
                                 "code is never run outside the sandbox")
    return path


SYSTEM_LIBRARIES = ("/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/lib32")
"""Where the dynamic loader finds the shared libraries the interpreter and its extension modules link."""

INTERPRETER_LAYOUT = ("import json, sys, sysconfig; print(json.dumps([sys.executable, *sys.path, "
                      "sysconfig.get_config_var('LIBDIR') or '']))")
"""Asked of the interpreter on the host (fixed code, not the model's): its executable, the standard
library's folders (``-I -S``: no site-packages) and the folder of ``libpython``."""


@functools.lru_cache(maxsize=8)
def interpreter_paths(python: str) -> Tuple[str, ...]:
    """The real paths the interpreter ``python`` reads: its executable first, then its folders."""
    try:
        out = subprocess.run([python, "-I", "-S", "-c", INTERPRETER_LAYOUT], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxUnavailable(f"the sandbox's interpreter {python} does not run: {e}") from e
    paths = [os.path.realpath(p) for p in json.loads(out) if p]
    return tuple(dict.fromkeys(p for p in paths if os.path.exists(p)))


def interpreter_binds(python: str) -> List[str]:
    """``bwrap`` arguments that show the sandbox the interpreter and nothing else of the host: the
    system library folders (symlinks kept as symlinks, as on merged-/usr systems), then the
    interpreter's executable and folders not already inside one of them."""
    args, bound = [], []
    for path in SYSTEM_LIBRARIES:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
            bound.append(path)
    for path in interpreter_paths(python):
        if not any(path == b or path.startswith(b + "/") for b in bound):
            args += ["--ro-bind", path, path]
            bound.append(path)
    return args


def bwrap_command(scratch: str, python: str) -> list:
    """The ``bwrap`` command line: the interpreter read-only, ``/tmp`` (the scratch folder) writable and
    nothing else (the new root is remounted read-only), a fresh ``/dev`` and ``/proc``, no network."""
    bwrap = bwrap_path()
    executable = interpreter_paths(python)[0]
    return [bwrap, *interpreter_binds(python), "--dev", "/dev", "--proc", "/proc", "--bind", scratch,
            "/tmp", "--remount-ro", "/", "--chdir", "/tmp", "--unshare-all", "--unshare-user", "--uid", "65534",
            "--gid", "65534", "--cap-drop", "ALL", "--die-with-parent",
            "--new-session", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
            executable, "-I", "-S", "-c"]


def run_python(code: str, wall_s: float = 5.0, cpu_s: int = 0, memory_mb: int = 256, max_procs: int = 16,
               max_file_mb: int = 16, python: str = "/usr/bin/python3") -> SandboxResult:
    """Run ``code`` with ``python`` in the sandbox; CPU time defaults to the wall-clock limit."""
    cpu = int(cpu_s or max(1, round(wall_s)))
    prelude = SANDBOX_PRELUDE.format(cpu=cpu, mem=memory_mb << 20, nproc=max_procs, fsize=max_file_mb << 20)
    with tempfile.TemporaryDirectory(prefix="sandbox-") as scratch:
        with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        os.chmod(scratch, 0o777)  # writable by the unprivileged user the sandbox runs as
        proc = subprocess.Popen(bwrap_command(scratch, python) + [prelude], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                **_unprivileged())
        try:
            out, err = proc.communicate(timeout=wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            out, err = proc.communicate()
            timed_out = True
        if proc.returncode != 0 and b"setting up uid map" in err:
            raise SandboxUnavailable(f"bwrap cannot create namespaces here: {err.decode(errors='replace')}")
    return SandboxResult(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"), timed_out)


def _unprivileged() -> dict:
    """As root, run bwrap as ``nobody``: the kernel does not apply ``RLIMIT_NPROC`` to host root (a
    fork bomb would go on), whatever uid the namespace shows."""
    return dict(user=NOBODY, group=NOBODY, extra_groups=[]) if os.getuid() == 0 else {}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
