"""What a failed run says: the innermost error, not Flyte's wrappers around it.

A local execution re-raises a task's exception with its message prefixed once per enclosing task
and dynamic workflow (``Error encountered while executing 'workflows.reinforce.reinforce_chunk':\\n
Error encountered while executing 'tasks.score.score':\\n  <the error>``); a cluster execution's
``FlyteError`` reads ``USER:ValueError: error=<the same>``; ``FlyteScopedException`` holds the
user's exception as ``.value``. :func:`root_cause` and :func:`innermost_error` peel those off, for the
failure handler's "run ... failed:" line and MLflow's ``end_reason`` (``models/run/end.py``).

:func:`short_config_errors` makes ``pyflyte run`` print a config or prompt-data error as its one-line
reason instead of a rich traceback of the workflow's frames (``RLHF_VERBOSE=1`` keeps the traceback).
"""

from __future__ import annotations

import re
import sys

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


def innermost_error(err: BaseException) -> BaseException:
    """The exception a user's code raised: flytekit's scoped wrappers unwrapped (``.value``), and an
    exception whose message is only wrappers followed to its ``__cause__`` / ``__context__``."""
    seen = set()
    while id(err) not in seen:
        seen.add(id(err))
        value = getattr(err, "value", None)
        nested = err.__cause__ or err.__context__
        if isinstance(value, BaseException):
            err = value
        elif not root_cause(str(err)) and nested is not None:
            err = nested
        else:
            break
    return err


def _user_error(err: BaseException):
    """The config or prompt-data error behind ``err``, if any (anywhere in its chain)."""
    from models.data.prompt_sources import PromptDataError
    from models.config import ConfigError

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        err = innermost_error(err)
        if isinstance(err, (ConfigError, PromptDataError)):
            return err
        err = err.__cause__ or err.__context__
    return None


def one_line(err: BaseException) -> str:
    """``err`` as the line ``pyflyte run`` prints for it."""
    return f"[flyte-rlhf] {type(err).__name__}: {root_cause(str(err), limit=4000)}"


def short_config_errors() -> None:
    """Inside ``pyflyte`` (its CLI module is loaded): a config or prompt-data error prints one line to
    stderr (and ``pyflyte`` exits 1), every other error flytekit's traceback; ``RLHF_VERBOSE=1``: tracebacks
    for all. Elsewhere (task pods, elastic workers, tests) nothing changes."""
    cli = sys.modules.get("flytekit.clis.sdk_in_container.utils")
    original = getattr(cli, "pretty_print_exception", None)
    if original is None or getattr(original, "_flyte_rlhf", False):
        return

    def pretty_print_exception(e: Exception, verbosity: int = 1):
        from models.console import verbose

        user = None if verbose() else _user_error(e)
        if user is None:
            return original(e, verbosity)
        print(f"{one_line(user)}\n(RLHF_VERBOSE=1 shows the traceback)", file=sys.stderr, flush=True)

    pretty_print_exception._flyte_rlhf = True
    cli.pretty_print_exception = pretty_print_exception
