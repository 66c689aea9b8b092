"""``prepare_run`` task: the entry of every training workflow (new run or resume), the adapter of
:func:`models.stages.prepare.prepare`."""

from __future__ import annotations

from typing import List, NamedTuple

from flytekit import Resources, task

from models.config import TrainConfig
from models.hosts.resident import start_services
from models.run import lock as run_lock
from models.run.types import PolicyState, RunHandle
from models.stages.prepare import prepare
from tasks import secrets
from tasks.deploy import REGISTERED, is_local_execution


class Prepared(NamedTuple):
    """``prepare_run``'s outputs: the config in force, the run's handle, the state its next iteration starts
    from (:class:`models.run.setup.RunSetup`) and the launch that holds the run's lock
    (:attr:`models.run.types.RunHandle.launch`: every task that renews the lock or calls a service gets it)."""

    cfg: TrainConfig
    run: RunHandle
    state: PolicyState
    launch: str


@task(retries=1, requests=Resources(cpu="2", mem="8Gi"),
      secret_requests=secrets.requests(secrets.S3, secrets.MLFLOW))
def prepare_run(preset: str, overrides: List[str], run_name: str, workflow: str) -> Prepared:
    """Check what the run needs, then load and check the config, validate prompts before any model
    loads, lay out the run (reference policy, initial critic, prompts), start the MLflow run; or resume
    ``run_name``. ``workflow`` (``ppo`` or ``reinforce``) must suit ``run.algorithm``. With ``run.resident``
    a local run's services start here, from the state it starts or resumes at (``models/hosts/resident.py``)."""
    secrets.load(secrets.S3, secrets.MLFLOW)
    setup = prepare(preset, overrides, run_name, workflow, None if is_local_execution() else REGISTERED)
    launch = run_lock.current_owner()  # the holder of the run's lock (models/run/lock.py)
    if setup.cfg.run.resident and is_local_execution():  # the services as child processes of this one (on a
        # cluster they are nodes of the execution: workflows/common.py's run_services)
        start_services(setup.cfg, setup.run.for_launch(launch), setup.state)
    return Prepared(*setup, launch)
