"""A service's life in its process (:func:`serve`: listen, say where, run the ops until stopped; a cluster's
service node runs it too), and a service as a child process of this one (:class:`ChildProcess`: its log, waited
on until it prints where it listens, the URL after :data:`READY`)::

    reward server ready on http://127.0.0.1:8123 (parts: critic, reward_model; auth: on)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

from models import processes
from models.service.client import ServiceGone
from models.service.ops import Host
from models.service.server import Server, Settings, serve_ranks

READY = " ready on "
REPO = str(Path(__file__).resolve().parents[2])


def serve(host: Host, settings: Settings, announce: Callable[[Server], None], listen: str = "127.0.0.1",
          port: int = 0, advertise: str = "", main: bool = True, share: Callable = lambda request: request,
          log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> Tuple[str, int]:
    """Serve ``host``'s ops until the service is stopped: on rank 0 (``main``) behind a :class:`Server` that
    ``announce`` makes known (prints its ready line, publishes its address), on the other ranks of a trainer
    service from rank 0 (``share``: a :class:`~models.service.ranks.RankFanout`). SIGTERM stops it as the
    ``stop`` op does. Returns why it stopped and how many requests it served."""
    if not main:
        return serve_ranks(host, None, share, log), 0
    server = Server(host, settings, listen, port, advertise, log)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: server.stop("SIGTERM"))
    try:
        announce(server)
        return server.serve(share), server.requests
    finally:
        server.close()


def end_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if ``proc`` has not exited within ``timeout_s``; nothing if it has exited."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ChildProcess:
    """A service as a child process (this checkout first on its path): ``command``, its output into ``log_path``,
    :attr:`url` once it printed its ready line; stopped on :meth:`stop` or leaving the ``with`` block."""

    def __init__(self, command: Sequence[str], log_path: str | Path, label: str = "the service",
                 env: Optional[Dict[str, str]] = None, timeout_s: float = 120.0):
        self.command, self.label, self.env, self.timeout_s = list(command), label, dict(env or {}), timeout_s
        self.log_path, self.proc, self.url = Path(log_path), None, ""
        self._ready = threading.Event()

    def spawn(self) -> "ChildProcess":
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, errors="replace")
        threading.Thread(target=self._read, daemon=True, name="child-log").start()
        return self

    def _read(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:  # keeps draining the pipe after the ready line
                log.write(line)
                log.flush()
                if READY in line and not self.url:
                    self.url = line.partition(READY)[2].split()[0]
                    self._ready.set()

    def wait_ready(self, timeout_s: Optional[float] = None) -> str:
        """The URL once the child said it is ready; :class:`ServiceGone` with its log's tail if it exits first
        or takes longer than ``timeout_s`` (it is stopped then)."""
        timeout_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                code = self.proc.poll()
                self.stop()
                what = f"did not get ready in {timeout_s:g} s" if code is None else \
                    f"exited with code {code} while starting{processes.memory_summary()}" if code >= 0 else \
                    "died while starting: " + processes.death_note(self.proc.pid, -code, "its process")
                raise ServiceGone(f"{self.label} {what}; its log ({self.log_path}) ends:\n{self.log_tail()}")
        return self.url

    def start(self) -> "ChildProcess":
        self.spawn().wait_ready()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (the service stops as on the ``stop`` op), SIGKILL after ``timeout_s``."""
        if self.proc is not None:
            end_process(self.proc, timeout_s)

    def log_tail(self, chars: int = 3000) -> str:
        time.sleep(0.2)  # the reader's last lines
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> "ChildProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
