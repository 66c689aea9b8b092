"""Run ``python -m models.server serve`` (or ``serve-rollout``) as a child process and wait until it
accepts requests.

    with ServerProcess(["--critic", url, "--token-env", "RS_TOKEN"], env={"RS_TOKEN": token}) as server:
        RewardCriticClient(server.url, token=token).health()
    with ServerProcess(["--checkpoint", url, "--engine", "hf"], command="serve-rollout") as server:
        RolloutClient(server.url).health()

The child binds ``--port 0`` (unless ``args`` name a port) and prints its ready line, from
which the URL is read; its log (stderr) goes to ``log_path`` or a temporary file, and the
log's tail is in the error if it exits or does not get ready in time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

READY = " server ready on "
"""What both servers' ready lines hold (``reward server ready on URL ...``), the URL after it."""


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


class ServerProcess:
    """The server as a child process; ``url`` once started; stopped on ``stop()`` / context exit."""

    def __init__(self, args: Sequence[str], env: Optional[Mapping[str, str]] = None,
                 log_path: Optional[str | Path] = None, host: str = "127.0.0.1", timeout_s: float = 120.0,
                 command: str = "serve"):
        """``command``: the CLI's subcommand, ``serve`` (reward/critic) or ``serve-rollout``."""
        self.args, self.env, self.host, self.timeout_s = list(args), dict(env or {}), host, timeout_s
        self.command = command
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"{command}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.proc: Optional[subprocess.Popen] = None
        self.url = ""

    def start(self) -> "ServerProcess":
        port = [] if "--port" in self.args else ["--port", "0"]
        repo = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "models.server", self.command, "--host", self.host,
                                          *port, *self.args], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        lines: list[str] = []

        def read_stdout() -> None:  # keeps draining the pipe after the ready line
            for line in self.proc.stdout:
                lines.append(line)

        threading.Thread(target=read_stdout, daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            ready = [line for line in lines if READY in line]
            if ready:
                self.url = ready[0].partition(READY)[2].split()[0]
                return self
            time.sleep(0.05)
        code = self.proc.poll()
        self.stop()
        raise RuntimeError(f"{self.command} did not get ready in {self.timeout_s:g} s (exit code {code}); "
                           f"log {self.log_path}:\n{self.log_path.read_text()[-3000:]}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (uvicorn shuts down gracefully), SIGKILL after ``timeout_s``."""
        if self.proc is not None:
            end_process(self.proc, timeout_s)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
