"""What a user sees when a run cannot start or is stopped: a config error's one-line reason from
``pyflyte run`` (the traceback with ``RLHF_VERBOSE=1``), and Ctrl-C without the reward workers'
tracebacks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.flyte_runs import isolated_env

pytestmark = pytest.mark.integration  # real `pyflyte run` and reward worker processes

ROOT = Path(__file__).resolve().parents[2]
PYFLYTE = Path(sys.executable).with_name("pyflyte")
BAD = ["run", "workflows/reinforce.py", "reinforce_training", "--preset", "configs/tiny_grpo.yaml",
       "--overrides", '["rollout.temperature=-1"]']
"""Fails in ``prepare_run``'s config check, before any model or MLflow run is made."""


def pyflyte(tmp_path, *args, verbose: bool = False):
    environ = isolated_env(tmp_path / "home", {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"})
    environ.pop("RLHF_VERBOSE", None)
    environ.update({"RLHF_VERBOSE": "1"} if verbose else {})
    return subprocess.run([str(PYFLYTE), *args], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300)


def test_a_config_error_prints_its_reason_on_one_line(tmp_path):
    out = pyflyte(tmp_path, *BAD)
    assert out.returncode == 1
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert lines == ["Running Execution on local.",
                     lines[1], "(RLHF_VERBOSE=1 shows the traceback)"], out.stdout + out.stderr
    assert lines[1].startswith("[flyte-rlhf] ConfigError: rollout.temperature=-1.0 is below 0.1: ")
    assert "Error encountered" not in lines[1] and "Traceback" not in out.stderr
    verbose = pyflyte(tmp_path, *BAD, verbose=True)
    assert verbose.returncode == 1 and "Traceback" in verbose.stdout + verbose.stderr
    assert "rollout.temperature=-1.0 is below 0.1" in verbose.stdout + verbose.stderr


INTERRUPTED = """
import sys, time
from models.rewards.workers import score_function
assert score_function("myrewards:match", ["q"] * 2, ["1", "2"], {"answer": ["1", "x"]}, timeout_s=60,
                      num_workers=2) == [1.0, 0.0]
try:  # "ready" inside the try: the signal follows it at once, before a statement after it could begin
    print("ready", flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
"""


def test_ctrl_c_reaches_the_run_not_its_reward_workers(tmp_path):
    """Ctrl-C signals the terminal's whole process group: the caller and its two reward workers."""
    (tmp_path / "myrewards.py").write_text("def match(prompts, responses, answer):\n"
                                           "    return [float(r == a) for r, a in zip(responses, answer)]\n")
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED], cwd=tmp_path, start_new_session=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == "ready\n"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert err == "interrupted\n"
