"""A run that does not finish is marked in MLflow (KILLED after SIGINT/SIGTERM, FAILED after an error),
its lock released, and one line says so (models/run/end.py): in the process of a local execution at exit,
and by the workflows' failure handler for a cluster execution."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import pytest
from flytekit import dynamic, task, workflow
from flytekit.types.error import FlyteError

from models.faults import SLOW_KEEPER_ENV
from models.rewards import RewardError
from models.run import end as run_end, lock as run_lock

from models import tracking
from models.run.layout import RunLayout

ROOT = Path(__file__).resolve().parents[3]
HOLDER = """
import os, signal, sys, time
from models.run import end as run_end, lock as run_lock
from models import tracking
from models.run.layout import RunLayout
root, how = sys.argv[1], sys.argv[2]
layout = RunLayout(root, "r")
run_id = tracking.start_run("flyte-rlhf", "r", {}, {"storage": layout.url})
run_lock.acquire(layout.lock_url, ttl_s=3600)
run_end.hold_if_local(root, "r", run_id, 3600)  # as prepare_run does in a local execution
print(run_id, flush=True)
if how == "error":
    raise RuntimeError("boom in a task")
os.kill(os.getpid(), getattr(signal, how))
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how, status", [("SIGINT", "KILLED"), ("SIGTERM", "KILLED"), ("error", "FAILED")])
def test_a_local_run_that_stops_is_marked_and_lets_go(tmp_path, monkeypatch, how, status):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    out = subprocess.run([sys.executable, "-c", HOLDER, str(tmp_path / "runs"), how], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    run_id = out.stdout.strip()
    assert out.returncode != 0 and run_id, out.stderr
    why = f"interrupted by {how}" if how != "error" else "failed (the error is above)"
    line = (f"[flyte-rlhf] run r {why}: MLflow run {run_id} marked {status}, lock released, no iteration committed "
            f"yet; rerun the same command to resume")
    assert line in out.stderr.splitlines()
    assert tracking.client().get_run(run_id).info.status == status
    lease = json.loads((tmp_path / "runs" / "r" / "lock.json").read_text())
    assert lease["released_at"]


@pytest.mark.slow
def test_a_local_run_whose_process_is_sigkilled_is_marked_failed_by_its_keeper(tmp_path, monkeypatch):
    """SIGKILL (the kernel's OOM killer) leaves the process no handler to run: its keeper says how it ended, marks
    the run FAILED and lets go of the lock (models/run/keeper_process.py), even when it reads what the process told
    it only after the process died (a loaded machine: ``RLHF_FAULT_SLOW_KEEPER``)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv(SLOW_KEEPER_ENV, "2")
    out = subprocess.run([sys.executable, "-c", HOLDER, str(tmp_path / "runs"), "SIGKILL"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)  # returns once the keeper, sharing stderr, has ended
    run_id = out.stdout.strip()
    assert out.returncode == -9 and run_id, out.stderr
    line = [x for x in out.stderr.splitlines() if x.startswith("[flyte-rlhf] run r failed: ")]
    assert len(line) == 1, out.stderr
    assert "the run's process python -c" in line[0] and "ended without running its exit handlers: killed by " \
        "SIGKILL" in line[0] and "its peak memory was " in line[0], line[0]
    assert line[0].endswith(f": MLflow run {run_id} marked FAILED, lock released, no iteration committed yet; rerun "
                            f"the same command to resume"), line[0]
    run = tracking.client().get_run(run_id)
    assert run.info.status == "FAILED" and "killed by SIGKILL" in run.data.tags["end_reason"]
    assert json.loads((tmp_path / "runs" / "r" / "lock.json").read_text())["released_at"]


def test_the_failure_handler_finds_a_cluster_run_by_its_execution(tmp_path, monkeypatch):
    from flytekit.models.core.identifier import WorkflowExecutionIdentifier

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    ex = WorkflowExecutionIdentifier("proj", "development", "exec-a")
    layout = RunLayout(str(tmp_path / "runs"), "r")
    run_id = tracking.start_run("flyte-rlhf", "r", {}, {"storage": layout.url, "flyte_execution_id": "exec-a"})
    other = tracking.start_run("flyte-rlhf", "other", {}, {"storage": layout.url + "x", "flyte_execution_id": "b"})
    run_lock.acquire(layout.lock_url, ttl_s=3600, owner=run_lock.execution_owner(ex))
    line = run_end.mark_failed("flyte-rlhf", "NonFiniteUpdate: all 4 optimiser steps ...", execution=ex)
    assert line.startswith(f"[flyte-rlhf] run r failed: NonFiniteUpdate: all 4 optimiser steps ...: MLflow run "
                           f"{run_id} marked FAILED, lock released")
    run = tracking.client().get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags["end_reason"].startswith("failed: NonFiniteUpdate")
    assert tracking.client().get_run(other).info.status == "RUNNING"  # another execution's run is left alone
    assert json.loads(Path(layout.lock_url).read_text())["released_at"]
    assert run_end.mark_failed("flyte-rlhf", "again", execution=ex) is None  # nothing RUNNING any more


# A training workflow's shape: a task failing inside a dynamic chunk, the workflow's on_failure handler
# given the error as flytekit reports it.
@task
def failing_score(i: int) -> int:
    if i >= 0:
        raise RewardError(f"reward 'myrewards:judge' raised on sample {i}: ZeroDivisionError('division by zero')")
    return i


@dynamic
def chunk(i: int) -> int:
    return failing_score(i=i)


HANDLED: List[str] = []


@task
def on_failure(i: int, err: Optional[FlyteError] = None) -> None:
    HANDLED.append(err.message)


@workflow(on_failure=on_failure)
def training(i: int = 3) -> int:
    return chunk(i=i)


def test_a_failed_iteration_is_reported_with_its_innermost_error(tmp_path, monkeypatch):
    from flytekit.models.core.identifier import WorkflowExecutionIdentifier

    with pytest.raises(RewardError):
        training(i=3)
    message = HANDLED[-1]
    assert message.startswith(f"Error encountered while executing '{__name__}.chunk':")  # flytekit's wrappers
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    ex = WorkflowExecutionIdentifier("proj", "development", "exec-c")
    layout = RunLayout(str(tmp_path / "runs"), "r")
    run_id = tracking.start_run("flyte-rlhf", "r", {}, {"storage": layout.url, "flyte_execution_id": "exec-c"})
    run_lock.acquire(layout.lock_url, ttl_s=3600, owner=run_lock.execution_owner(ex))
    line = run_end.mark_failed("flyte-rlhf", message, execution=ex)
    why = "failed: reward 'myrewards:judge' raised on sample 3: ZeroDivisionError('division by zero')"
    assert line.startswith(f"[flyte-rlhf] run r {why}: MLflow run {run_id} marked FAILED")
    assert tracking.client().get_run(run_id).data.tags["end_reason"] == why


def test_a_damaged_checkpoint_is_not_answered_with_a_resume(tmp_path, monkeypatch):
    """A committed checkpoint that fails its check in an iteration: a resume would load it again, so the line
    says what can be done instead."""
    from flytekit.models.core.identifier import WorkflowExecutionIdentifier

    from models.checkpoint import CheckpointError, download_checkpoint, save_checkpoint
    from tests.unit.models.test_checkpoint import hf_dir

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    layout = RunLayout(str(tmp_path / "runs"), "r")
    save_checkpoint(hf_dir(tmp_path / "src"), layout.actor_url(0))
    (Path(layout.actor_url(0)) / "config.json").write_text('{"model_type": "llamb"}')  # same size
    with pytest.raises(CheckpointError) as err:
        download_checkpoint(layout.actor_url(0))
    ex = WorkflowExecutionIdentifier("proj", "development", "exec-d")
    run_id = tracking.start_run("flyte-rlhf", "r", {}, {"storage": layout.url, "flyte_execution_id": "exec-d"})
    run_lock.acquire(layout.lock_url, ttl_s=3600, owner=run_lock.execution_owner(ex))
    wrapped = f"Error encountered while executing 'tasks.rollout.rollout':\n  {err.value}"  # as flytekit says it
    line = run_end.mark_failed("flyte-rlhf", wrapped, execution=ex)
    assert "file 'config.json' fails its blake3 check" in line
    assert line.endswith("no iteration committed yet; a resume cannot repair it (the run would go on from this "
                         "checkpoint): restore the file from a copy (the run's MLflow artifacts hold the checkpoints "
                         "it logged), or train under a new --run_name")
