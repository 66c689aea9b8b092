"""What a failed run says: the innermost error of a Flyte error message, not Flyte's wrappers around it.

A local execution re-raises a task's exception with its message prefixed once per enclosing task
and dynamic workflow (``Error encountered while executing 'workflows.reinforce.reinforce_chunk':\\n
Error encountered while executing 'tasks.score.score':\\n  <the error>``); a cluster execution's
``FlyteError`` reads ``USER:ValueError: error=<the same>``. :func:`root_cause` peels those off, for the
failure handler's "run ... failed:" line and MLflow's ``end_reason`` (``models/run/end.py``), and for
what ``pyflyte run`` prints for a config error (``tasks/cli_errors.py``, which also unwraps flytekit's
exception objects).
"""

from __future__ import annotations

import re

_WRAPPER = re.compile(r"Error encountered while (?:executing|converting inputs of) '[^']*':[ \t]*\n?[ \t]*")
"""flytekit's prefix for a task's or workflow's error in a local execution (``flytekit.core.base_task``)."""


def root_cause(message: str, limit: int = 500) -> str:
    """The innermost error of a Flyte error message, on one line: what follows the last ``error=`` and the
    last "Error encountered while executing" wrapper, up to a blank line or a traceback."""
    inner = _WRAPPER.split(message.rsplit("error=", 1)[-1])[-1]
    lines = []
    for line in inner.strip().splitlines():
        if not line.strip() or line.startswith("Traceback"):
            break
        lines.append(line.strip())
    return " ".join(lines)[:limit]
