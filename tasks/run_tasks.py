"""``prepare_run`` task: the entry of every training workflow (new run or resume)."""

from __future__ import annotations

from typing import List

from flytekit import Resources, task

from models.run import end as run_end

from tasks import secrets
from models.run.setup import RunSetup, setup_run


def check_before_setup(preset: str, overrides: List[str], run_name: str, workflow: str = "") -> None:
    """Every check that can fail the run and needs nothing created first: in a remote execution the
    cluster-facing ones of :func:`models.run.preflight.check_remote_run` (for a resumed run, against the
    config it was started with), in any run that the tracking server answers."""
    from models import storage
    from models import tracking
    from models.config.io import config_from_json_dict, load_config
    from tasks.deploy import check_topology, deployment_config, is_local_execution
    from models.run.preflight import check_remote_run, check_tracking
    from models.run.layout import RunLayout

    from models.run.setup import DEFAULT_PRESETS

    cfg = load_config(preset or DEFAULT_PRESETS.get(workflow, DEFAULT_PRESETS["ppo"]), list(overrides))
    if is_local_execution():
        check_tracking(tracking.tracking_uri(), remote=False)
        return
    check_remote_run(cfg, deployment_config())
    name = run_name or cfg.run.name
    layout = RunLayout(cfg.run.storage_root, name) if name else None
    if layout is not None and storage.exists(layout.run_info_url):  # a resume runs the stored topology
        check_topology(config_from_json_dict(layout.read_run_info().config), deployment_config())


@task(retries=1, requests=Resources(cpu="2", mem="8Gi"),
      secret_requests=secrets.requests(secrets.S3, secrets.MLFLOW))
def prepare_run(preset: str, overrides: List[str], run_name: str, workflow: str) -> RunSetup:
    """Check what the run needs (:func:`check_before_setup`), then load and check the config, validate
    prompts before any model loads, lay out the run (reference policy, initial critic, prompts), start
    the MLflow run; or resume ``run_name``. ``workflow`` (``ppo`` or ``reinforce``) must suit
    ``run.algorithm``."""
    secrets.load(secrets.S3, secrets.MLFLOW)
    check_before_setup(preset, overrides, run_name, workflow)
    setup = setup_run(preset, overrides, run_name, workflow)
    run_end.hold_if_local(setup.run.storage_root, setup.run.run_name, setup.run.mlflow_run_id, setup.cfg.run.lock_ttl_s)
    return setup
