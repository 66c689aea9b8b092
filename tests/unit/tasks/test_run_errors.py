"""The innermost error of a failure, however flytekit wrapped it (models/run/errors.py, tasks/cli_errors.py);
the failure handler's line and ``pyflyte run``'s one line for a config error are shown through their callers
in test_run_end.py and tests/integration/test_failure_messages.py."""

from __future__ import annotations

import sys

from flytekit.exceptions.scopes import FlyteScopedUserException

from models.config import ConfigError
from models.config.io import load_config
from models.run.errors import root_cause
from tasks.cli_errors import _user_error, innermost_error, one_line


def test_root_cause_peels_every_wrapper_and_keeps_a_multi_line_reason():
    message = ("Error encountered while executing 'workflows.reinforce.reinforce_chunk':\n"
               "  Error encountered while converting inputs of 'tasks.score.score':\n"
               "  3 prompts are too long:\nrow 4: 900 tokens\n\nTraceback (most recent call last):\n  ...")
    assert root_cause(message) == "3 prompts are too long: row 4: 900 tokens"
    assert root_cause("USER:ValueError: error=boom") == "boom"
    assert root_cause("plain") == "plain"


def test_a_config_error_is_found_inside_flytekits_scoped_wrapper():
    try:
        load_config("configs/tiny_grpo.yaml", ["run.registered_model_name=a:b"])
    except ConfigError as err:
        err.args = (f"Error encountered while executing 'tasks.run_tasks.prepare_run':\n  {err}",)
        scoped = FlyteScopedUserException(*sys.exc_info())
    wrapped = RuntimeError("Error encountered while executing 'workflows.ppo.ppo_training':")
    wrapped.__cause__ = scoped
    assert innermost_error(wrapped) is scoped.value
    assert one_line(_user_error(wrapped)).startswith("[flyte-rlhf] ConfigError: run.registered_model_name='a:b' ")
    assert _user_error(RuntimeError("a bug")) is None  # not a config error: flytekit's traceback stays
