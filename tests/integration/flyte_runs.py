"""Running ``pyflyte run`` as a child process for the reliability tests: in its own process
group (so SIGKILL takes the elastic workers too), with Flyte's local task cache in a private
home folder (no test reads or pollutes ``~/.flyte``), stdout and stderr in a log file."""

from __future__ import annotations

import getpass
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
PYFLYTE = os.path.join(os.path.dirname(sys.executable), "pyflyte")


def isolated_env(home: Path, extra: Optional[Mapping[str, str]] = None) -> dict:
    """This environment with ``HOME`` (hence Flyte's ``~/.flyte/local-cache``) under ``home``;
    the demo-model cache, matplotlib's font cache and vLLM's cache stay where they are (they are keyed by
    content, as a user's stay between runs: without its ``modelinfos``, every vLLM engine inspects the model's
    class in a fresh interpreter that imports vLLM, 5-10 s of CPU), and so does torch inductor's, where a test sets
    its own ``TMPDIR`` (inductor's default is under it: vLLM's sampler compiled its kernels again in each such run,
    ~12 s of the first rollout)."""
    from models.demos.builders import cache_dir

    env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error",
               VLLM_LOGGING_LEVEL="WARNING", RLHF_CACHE_DIR=cache_dir(),
               MPLCONFIGDIR=os.environ.get("MPLCONFIGDIR") or os.path.expanduser("~/.cache/matplotlib"),
               VLLM_CACHE_ROOT=os.environ.get("VLLM_CACHE_ROOT") or os.path.expanduser("~/.cache/vllm"),
               TORCHINDUCTOR_CACHE_DIR=inductor_cache())
    env["HOME"] = str(home)
    home.mkdir(parents=True, exist_ok=True)
    env.update(extra or {})
    return env


def inductor_cache() -> str:
    """Torch inductor's cache folder as this process has it (``$TORCHINDUCTOR_CACHE_DIR``, else its default under
    ``$TMPDIR``), for a child given a ``TMPDIR`` of its own."""
    return (os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            or os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))


class FlyteRun:
    """``pyflyte run <workflow> <entry> --preset ... --overrides ... --run_name ...`` in the background."""

    def __init__(self, workflow: str, entry: str, preset: str, overrides: Sequence[str], run_name: str,
                 env: Mapping[str, str], log: Path):
        cmd = [PYFLYTE, "run", workflow, entry, "--preset", preset, "--overrides", json.dumps(list(overrides)),
               "--run_name", run_name]
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout_s: float = 600) -> str:
        """Wait for a normal end; the output, or an AssertionError with its tail."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"pyflyte did not finish in {timeout_s} s:\n{self.output()[-4000:]}")
        assert code == 0, f"pyflyte exited with {code}:\n{self.output()[-6000:]}"
        return self.output()

    def wait_until(self, condition: Callable[[], bool], what: str, timeout_s: float = 600) -> None:
        """Poll ``condition`` until true; fail (killing the run) if the run ends or time runs out first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended (exit {self.proc.returncode}) before {what}:\n"
                                     f"{self.output()[-6000:]}")
            time.sleep(0.2)
        self.kill()
        raise AssertionError(f"timed out waiting for {what}:\n{self.output()[-4000:]}")

    def descendants(self):
        import psutil

        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """SIGKILL the whole process group (pyflyte, the elastic agent and its workers)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone already
            pass
        self.proc.wait(timeout=60)
