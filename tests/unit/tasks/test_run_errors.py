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


def _failures(tmp_path, errors: dict):
    """torchrun's own ``ProcessFailure`` records read from the error files its workers write."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    found = {}
    for rank, (message, stamp) in errors.items():
        path = tmp_path / f"error-{rank}.json"
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": "...",
                                                                                   "timestamp": str(stamp)}}}))
        found[rank] = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=1, error_file=str(path))
    return found


def test_an_error_every_rank_raised_is_named_on_rank_0_whichever_wrote_first(tmp_path):
    """Both ranks raise NonFiniteUpdate and torchrun recorded both (they exited within one monitor tick);
    rank 1's error file is stamped a second earlier: the report names rank 0 and says rank 1 failed the
    same way, and a different error is still the root cause when it came first."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from tasks.elastic import first_failure, root_cause_first

    same = ChildFailedError("actor_update", _failures(tmp_path, {0: ("NonFiniteUpdate: all 4 steps (loss nan)", 101),
                                                                 1: ("NonFiniteUpdate: all 4 steps (loss inf)", 100)}))
    assert first_failure(same)[0] == 0
    assert same.get_first_failure()[0] == 1  # torchrun's own choice: the race
    report = root_cause_first(same)
    assert report.splitlines()[0] == "the actor update failed on rank 0: NonFiniteUpdate: all 4 steps (loss nan) " \
                                     "(also on rank 1)"
    other = ChildFailedError("actor_update", _failures(tmp_path, {0: ("DistBackendError: peer closed", 101),
                                                                  1: ("MemoryError: out of host memory", 100)}))
    assert root_cause_first(other, "critic_update").splitlines()[0] == \
        "the critic update failed on rank 1: MemoryError: out of host memory"
