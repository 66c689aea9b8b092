"""The actor update leaves only the process group it made (models/training/distributed.py).

In a local run the single-worker actor update runs in the ``pyflyte`` process, beside the in-process
vLLM engine, which made a gloo world of one and its tensor-parallel group there. The update used to
destroy that world when it ended, and the engine's own shutdown then failed on its group ("vLLM
shutdown: Invalid process group specified" at the end of ``make demo TASK=tools``).

Each case runs in a fresh interpreter (``spawn``), as a task's process starts: a process has one
default group, and a test worker may hold one already (an in-process engine of an earlier test)."""

from __future__ import annotations

import multiprocessing
import os
import traceback

import pytest
import torch.distributed as dist

from models.training.distributed import init_distributed, join_process_group, shutdown_distributed

pytestmark = pytest.mark.slow  # a fresh interpreter per case (torch's import: ~1.5 s of CPU each)


def _engine_then_update(store: str) -> None:
    # What vLLM's in-process engine does at start: a world of one, then its groups (GroupCoordinator).
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    tp_group = dist.new_group([0], backend="gloo")
    info = init_distributed()  # actor_update, run in the same process
    assert info.world_size == 1
    shutdown_distributed()
    assert dist.is_initialized()
    dist.destroy_process_group(tp_group)  # the engine's shutdown: its group is still there to destroy
    dist.destroy_process_group()


def _update_alone(store: str) -> None:
    join_process_group(backend="gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    shutdown_distributed()
    assert not dist.is_initialized()


def _child(case, store: str, errors) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(name, None)
    try:
        assert not dist.is_initialized()
        case(store)
    except BaseException:
        errors.put(traceback.format_exc())
        raise


def run_fresh(case, store: str) -> str:
    """``case(store)`` in a new interpreter with no process group: "" when it passed, else its traceback
    (or its exit code)."""
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    proc = ctx.Process(target=_child, args=(case, store, errors))
    proc.start()
    proc.join(120)
    if proc.exitcode == 0:
        return ""
    return errors.get(timeout=5) if not errors.empty() else f"exit code {proc.exitcode}"


def test_the_update_leaves_an_engines_process_group_alone(tmp_path):
    assert run_fresh(_engine_then_update, str(tmp_path / "store")) == ""


def test_a_group_the_update_made_is_left_when_it_ends(tmp_path):
    assert run_fresh(_update_alone, str(tmp_path / "store")) == ""


def test_a_failing_case_is_reported(tmp_path):
    """The harness itself can fail: a case whose assertion fails is reported with it."""
    assert "assert not dist.is_initialized" in run_fresh(_leaves_the_world_up, str(tmp_path / "store"))


def _leaves_the_world_up(store: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    assert not dist.is_initialized()
