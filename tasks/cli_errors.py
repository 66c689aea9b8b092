"""What ``pyflyte run`` prints for a config or prompt-data error: its one-line reason, not a rich
traceback of the workflow's frames (``RLHF_VERBOSE=1`` keeps the traceback). :func:`short_config_errors`
is called by ``tasks/__init__.py``; the error's text is peeled by :func:`models.run.errors.root_cause`,
flytekit's wrapper exceptions by :func:`innermost_error`.
"""

from __future__ import annotations

import sys

from models.run.errors import root_cause
from tasks.flyte_internals import replace_cli_error_printer, wrapped_error


def innermost_error(err: BaseException) -> BaseException:
    """The exception a user's code raised: flytekit's scoped wrappers unwrapped (``.value``), and an
    exception whose message is only wrappers followed to its ``__cause__`` / ``__context__``."""
    seen = set()
    while id(err) not in seen:
        seen.add(id(err))
        value = wrapped_error(err)
        nested = err.__cause__ or err.__context__
        if value is not None:
            err = value
        elif not root_cause(str(err)) and nested is not None:
            err = nested
        else:
            break
    return err


def _user_error(err: BaseException):
    """The config or prompt-data error behind ``err``, if any (anywhere in its chain)."""
    from models.config import ConfigError
    from models.data.prompt_sources import PromptDataError

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
    """Inside ``pyflyte``: a config or prompt-data error prints one line to stderr (and ``pyflyte`` exits 1),
    every other error flytekit's traceback; ``RLHF_VERBOSE=1``: tracebacks for all. Elsewhere (task pods,
    elastic workers, tests) nothing changes."""

    def wrap(original):
        def pretty_print_exception(e: Exception, verbosity: int = 1):
            from models.console import verbose

            user = None if verbose() else _user_error(e)
            if user is None:
                return original(e, verbosity)
            print(f"{one_line(user)}\n(RLHF_VERBOSE=1 shows the traceback)", file=sys.stderr, flush=True)

        return pretty_print_exception

    replace_cli_error_printer(wrap)
