"""What `make demo` (a plain `pyflyte run`) prints: the project's own lines, not the libraries'
chatter (models/console.py). One iteration of the PPO demo in a clean environment (no quieting
variables inherited from this pytest process). That RLHF_VERBOSE=1 brings the libraries back is
checked in a fresh interpreter by tests/unit/models/test_console.py (a second pyflyte run here cost
minutes of the CI budget for the same switch)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from models import console

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PYFLYTE = os.path.join(os.path.dirname(sys.executable), "pyflyte")

LIBRARY_LINES = {
    "transformers' weight bars": r"Loading weights|Writing model shards",
    "vLLM's safetensors bars": r"Loading safetensors checkpoint shards",
    "vLLM's log lines": r"^\(\w+ pid=\d+\) (INFO|WARNING|DEBUG)",
    "vLLM's Triton notice": r"Triton is installed, but doesn't include CPU backend",
    "vLLM's benign reload report": r"RotaryEmbedding: Failed to load weights",
    "torch's C++ notices": r"^\[W\d{4} ",
    "MLflow's notices": r"INFO mlflow\.|WARNING mlflow\.transformers|Successfully registered model|Created version",
    "deprecation warnings": r"DeprecationWarning|FutureWarning",
    "any other progress bar": r"\d+%\|",  # tqdm's "  0%|    | 0/3": off by each library's switch, not TQDM_DISABLE
}
"""Each a line the libraries printed in this run before models/console.py (2026-11-24)."""


def demo_run(tmp_path: Path, name: str, **env_extra) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in console.QUIET_ENV and k not in ("PYTHONWARNINGS", "TQDM_DISABLE", console.VERBOSE_ENV)}
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}", PYTHONUNBUFFERED="1",
               HOME=str(tmp_path / "home"), **env_extra)
    overrides = [f"run.storage_root={tmp_path / 'runs'}", "run.num_iterations=1", "run.eval_interval=0",
                 "rollout.prompts_per_iteration=8", "actor.minibatch_size=32", "actor.micro_batch_size=16",
                 "critic.minibatch_size=32", "critic.micro_batch_size=32", "data.num_demo_train_prompts=64",
                 "data.num_demo_eval_prompts=8"]
    proc = subprocess.run([PYFLYTE, "run", "workflows/ppo.py", "ppo_training", "--preset", "configs/tiny_ppo.yaml",
                           "--overrides", json.dumps(overrides), "--run_name", name],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def library_lines(out: str) -> dict:
    return {what: [line for line in out.splitlines() if re.search(pattern, line)][:3]
            for what, pattern in LIBRARY_LINES.items()}


def test_the_demo_prints_its_own_lines_only(tmp_path):
    quiet = demo_run(tmp_path, "quiet")
    assert "[ppo] iter 1/1" in quiet and "Run quiet finished: 1 iteration of ppo." in quiet
    assert {what: lines for what, lines in library_lines(quiet).items() if lines} == {}, quiet[-4000:]
