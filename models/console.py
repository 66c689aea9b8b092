"""A quiet console: the project's own lines and real warnings, not the libraries' chatter.

A run prints its set-up, a progress line per iteration and a summary. Left alone, the libraries
under it print four times as much: transformers' "Loading weights" and "Writing model shards"
bars, vLLM's start-up and CPU notices (``INFO ... non-default args``, "libtcmalloc is not found",
"Triton is installed, but doesn't include CPU backend"), its "Loading safetensors checkpoint
shards" bars and, after every in-place reload, "RotaryEmbedding: Failed to load weights" (benign: a
module without weights), MLflow's database and model-card notices, torch's C++ NUMA notice and
third-party ``DeprecationWarning``/``FutureWarning``s. :func:`quiet_libraries` turns those off;
``RLHF_VERBOSE=1`` leaves every library as it is.

What is never hidden: a warning or error the project emits itself (``tasks``, ``models``,
``kernels``, ``workflows`` loggers and warnings), errors of any library, and vLLM's reports of a
weight it could not load, which ``models/engines/vllm_engine.py`` captures whatever the log level and turns
into a failed reload (the engine restarts, with a warning naming the weights).

It is called where a process starts using the project: on import of :mod:`tasks` and
:mod:`workflows` (``pyflyte run``, a task pod's ``pyflyte-execute``, the elastic workers), by the
servers (``python -m models.hosts``) and by the demos' model builders (``python -m models.demos.math_demo``,
``python -m models.demos.tool_demo``). Environment variables are set with ``setdefault``, so a value
the user exported wins, and child processes (elastic workers, vLLM's) inherit them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from typing import Iterator

VERBOSE_ENV = "RLHF_VERBOSE"
"""Set to 1 (or true/yes) to keep every library's console output."""

QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",  # transformers' info and advisory warnings
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' and the Hub's tqdm bars (read at import)
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",  # datasets' bars (data.source=hf)
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's start-up, CPU and reload notices
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10's "[W...] Warning: NUMA binding ..." (read when torch loads)
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # "Creating initial MLflow database tables..."
}
"""Environment read by the libraries at import (or at their children's start). Each library's own
switch, never tqdm's global ``TQDM_DISABLE``: that would reach the user's own bars too, and vLLM 0.32's
``LLM.generate`` bar divides by zero under it. vLLM's bars are off where the project calls it
(``use_tqdm_on_load``, ``use_tqdm=False`` in ``models/engines/vllm_engine.py``)."""

QUIET_LOGGERS = {
    "vllm": logging.ERROR,
    "transformers": logging.ERROR,
    "mlflow": logging.WARNING,
    "mlflow.transformers": logging.ERROR,  # "model card could not be retrieved", "license information"
    "torch.distributed.elastic": logging.WARNING,
    "filelock": logging.WARNING,
    "urllib3": logging.WARNING,
}
"""Loggers of libraries already imported (the environment above comes too late for them)."""

QUIET_MESSAGES = {
    "torch.distributed.elastic.agent.server.api": r"Received \S+ death signal",
    "torch.distributed.elastic.multiprocessing.api": r"Closing process \d+ via signal",
}
"""Warnings dropped by message: torch elastic's notes on Ctrl-C or SIGTERM during an update, which the
run says once itself ("run ... interrupted by SIGINT", ``models/run/end.py``)."""

OWN_PACKAGES = r"(tasks|models|kernels|workflows|benchmarks)(\.|$)"


def verbose() -> bool:
    """Whether ``RLHF_VERBOSE`` asks for every library's output."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def quiet_libraries() -> None:
    """Turn library chatter off for this process and its children, unless :func:`verbose`."""
    if verbose():
        return
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    # Children start without this process's warning filters: PYTHONWARNINGS carries them.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning,ignore::FutureWarning")
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
        warnings.filterwarnings("default", category=category, module=OWN_PACKAGES)  # ours stay visible
    for name, level in QUIET_LOGGERS.items():
        logger = logging.getLogger(name)
        if logger.level < level:
            logger.setLevel(level)
    for name, pattern in QUIET_MESSAGES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(pattern))
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


class _DropMessages(logging.Filter):
    """Drops the records whose message matches ``pattern``."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


@contextlib.contextmanager
def mlflow_events_off() -> Iterator[None]:
    """MLflow's event lines during the call ("Successfully registered model ...", "Created version
    ..." are printed, not logged) off, unless :func:`verbose`; its exceptions still propagate."""
    if verbose():
        yield
        return
    from mlflow.utils import logging_utils

    logging_utils.disable_logging()
    try:
        yield
    finally:
        logging_utils.enable_logging()
