"""Bookkeeping tasks of a run: ``commit_iteration`` (the resume point, metrics, retention), ``evaluate``
(held-out prompts), ``finish_run`` (summary) and ``training_failed``: the adapters of
:mod:`models.stages.commit`, :mod:`~models.stages.evaluate` and :mod:`~models.stages.finish`."""

from __future__ import annotations

import sys
from typing import Dict, List, Optional

from flytekit import Resources, task
from flytekit.types.error import FlyteError

from models.config import TrainConfig
from models.data.batch import RolloutBatch
from models.hosts.resident import stop_all_services, stop_services
from models.run import lock as run_lock
from models.run.types import PolicyState, RunHandle
from models.stages.commit import run_commit
from models.stages.outputs import TrainingSummary
from tasks import batch_type, secrets  # noqa: F401  (batch_type: RolloutBatch as a Flyte type)
from tasks.deploy import REGISTERED, resources_for


@task(retries=2, requests=Resources(cpu="1", mem="2Gi"), secret_requests=secrets.requests(secrets.S3, secrets.MLFLOW))
def commit_iteration(cfg: TrainConfig, run: RunHandle, state: PolicyState, stats: List[Dict[str, float]],
                     batch: RolloutBatch, actor_url: str, critic_url: str, launch: str = "") -> PolicyState:
    """Write ``state.json`` (the resume point), log the iteration's metrics and samples, prune checkpoints.
    ``launch``: the holder of the run's lock (``prepare_run``'s), in whichever execution of the run this runs."""
    secrets.load(secrets.S3, secrets.MLFLOW)
    run = run.for_launch(launch)
    with run_lock.heartbeat(run.layout.lock_url, run.launch):
        return run_commit(cfg, run, state, stats, batch, actor_url, critic_url)


@task(retries=2, secret_requests=secrets.requests(secrets.S3, secrets.MLFLOW, secrets.SERVER),
      **resources_for(REGISTERED, "rollout"))
def evaluate(cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str = "") -> float:
    """Mean reward on the held-out prompts of the policy in ``state`` (logged at the iteration that made it)."""
    from models.stages.evaluate import run_evaluate  # here: commit_iteration's pod imports no torch

    secrets.load(secrets.S3, secrets.MLFLOW, secrets.SERVER)
    run = run.for_launch(launch)
    with run_lock.heartbeat(run.layout.lock_url, run.launch):
        return run_evaluate(cfg, run, state)


@task(retries=1, requests=Resources(cpu="2", mem="8Gi"),
      secret_requests=secrets.requests(secrets.S3, secrets.MLFLOW, secrets.SERVICE))
def finish_run(cfg: TrainConfig, run: RunHandle, state: PolicyState, launch: str = "") -> TrainingSummary:
    """Log and register the final policy (alias ``candidate``), close the MLflow run and summarise
    (first iteration's reward, mean of the last two)."""
    from models.stages.finish import run_finish

    secrets.load(secrets.S3, secrets.MLFLOW, secrets.SERVICE)  # SERVICE: a resident run's stop op
    run = run.for_launch(launch)
    # A resident run's services (this process's children locally, the service nodes on a cluster): the
    # run's checkpoints are all committed by now.
    stop_services(run, finished=True)
    with run_lock.heartbeat(run.layout.lock_url, run.launch):
        return run_finish(cfg, run, state)


@task(retries=1, secret_requests=secrets.requests(secrets.S3, secrets.MLFLOW))
def training_failed(preset: str, overrides: List[str], run_name: str, err: Optional[FlyteError] = None) -> None:
    """``on_failure`` of the training workflows: the run this execution trained is marked FAILED in MLflow
    (the error as its ``end_reason`` tag) and its lock released (``models/run/end.py``)."""
    from models.stages.finish import mark_failed

    secrets.load(secrets.S3, secrets.MLFLOW)
    stop_all_services()  # a resident run's, started by this process
    line = mark_failed(preset, overrides, err.message if err is not None else "unknown error")
    if line:
        print(line, file=sys.stderr, flush=True)
