"""Tasks of scheduled retraining (``workflows/retrain.py``): the adapters of
:func:`models.stages.retrain.plan` and :func:`models.stages.retrain.decide`."""

from __future__ import annotations

import datetime as dt
from typing import List

from flytekit import Resources, task

from models.config import TrainConfig
from models.run.types import RunHandle
from models.stages.outputs import TrainingSummary
from models.stages.retrain import RetrainPlan, RetrainResult, decide, plan
from tasks import secrets
from tasks.deploy import REGISTERED, resources_for


@task(retries=1, requests=Resources(cpu="2", mem="8Gi"), secret_requests=secrets.requests(secrets.S3, secrets.MLFLOW))
def plan_retrain(prompts_root: str, run_date: dt.datetime, registered_model_name: str, preset: str,
                 overrides: List[str], base_checkpoint: str, heldout_prompts: str) -> RetrainPlan:
    """Resolve ``champion`` (else ``base_checkpoint``, else the preset's model) into a checkpoint on
    the run storage, and the overrides that train it on ``{prompts_root}/{date}/``."""
    secrets.load(secrets.S3, secrets.MLFLOW)
    return plan(prompts_root, run_date, registered_model_name, preset, overrides, base_checkpoint, heldout_prompts)


@task(retries=1, secret_requests=secrets.requests(secrets.S3, secrets.MLFLOW),
      **resources_for(REGISTERED, "rollout"))
def promote_if_better(cfg: TrainConfig, run: RunHandle, summary: TrainingSummary, champion_version: str,
                      min_improvement: float) -> RetrainResult:
    """Evaluate candidate and champion on the same held-out prompts; move ``champion`` to the
    candidate only if its mean reward is higher by more than ``min_improvement``."""
    secrets.load(secrets.S3, secrets.MLFLOW)
    return decide(cfg, run, summary, champion_version, min_improvement)
