"""What `make demo` (a plain `pyflyte run`) may print: the project's own lines, not the libraries'
chatter (models/console.py). ``test_algorithms.py::test_learns_the_tiny_task[ppo]`` runs the PPO demo in
:func:`demo_env` (no quieting variables inherited from the pytest process) and checks its output with
:func:`library_lines`. That RLHF_VERBOSE=1 brings the libraries back is checked in a fresh interpreter by
tests/unit/models/test_console.py (a second pyflyte run here cost minutes of the CI budget for the same
switch)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from models import console

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


def demo_env(home: Path, **extra: str) -> dict:
    """This environment as a user's shell has it: none of the variables that quiet the libraries
    (``models.console.QUIET_ENV``, ``TQDM_DISABLE``, ``PYTHONWARNINGS``, ``RLHF_VERBOSE``) inherited from
    the pytest process, ``HOME`` (Flyte's local cache) under ``home``."""
    env = {k: v for k, v in os.environ.items()
           if k not in console.QUIET_ENV and k not in ("PYTHONWARNINGS", "TQDM_DISABLE", console.VERBOSE_ENV)}
    env.update(PYTHONUNBUFFERED="1", HOME=str(home), **extra)
    return env


def library_lines(out: str) -> dict:
    return {what: [line for line in out.splitlines() if re.search(pattern, line)][:3]
            for what, pattern in LIBRARY_LINES.items()}

