"""``prepare_run`` task: the entry of every training workflow (new run or resume)."""

from __future__ import annotations

from typing import List

from flytekit import Resources, task

from tasks import run_end, secrets
from tasks.setup import RunSetup, setup_run


@task(retries=1, requests=Resources(cpu="2", mem="8Gi"), secret_requests=secrets.requests(secrets.S3, secrets.MLFLOW))
def prepare_run(preset: str, overrides: List[str], run_name: str, workflow: str) -> RunSetup:
    """Load and check the config, validate prompts before any model loads, lay out the run
    (reference policy, initial critic, prompts), start the MLflow run; or resume ``run_name``.
    ``workflow`` (``ppo`` or ``reinforce``) must suit ``run.algorithm``."""
    secrets.load(secrets.S3, secrets.MLFLOW)
    setup = setup_run(preset, overrides, run_name, workflow)
    run_end.hold_if_local(setup.run.storage_root, setup.run.run_name, setup.run.mlflow_run_id, setup.cfg.run.lock_ttl_s)
    return setup
