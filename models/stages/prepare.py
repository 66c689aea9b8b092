"""A run's launch as the training workflows' first stage: the checks that need nothing created, then
the run laid out or resumed (``models/run/setup.py``)."""

from __future__ import annotations

from typing import List, Optional

from models import storage, tracking
from models.config import TrainConfig
from models.config.io import config_from_json_dict, load_config
from models.run import end as run_end
from models.run.layout import RunLayout
from models.run.preflight import check_local_resident, check_remote_run, check_topology, check_tracking
from models.run.setup import DEFAULT_PRESETS, RunSetup, setup_run


def check_before_setup(preset: str, overrides: List[str], run_name: str, workflow: str = "",
                       deployment: Optional[TrainConfig] = None) -> None:
    """Every check that can fail the run and needs nothing created first: in a remote execution (one
    with the ``deployment`` config its tasks were registered with) the cluster-facing ones of
    :func:`models.run.preflight.check_remote_run` (for a resumed run, against the config it was started
    with), in any run that the tracking server answers."""
    cfg = load_config(preset or DEFAULT_PRESETS.get(workflow, DEFAULT_PRESETS["ppo"]), list(overrides))
    if deployment is None:
        check_local_resident(cfg)
        check_tracking(tracking.tracking_uri(), remote=False)
        return
    check_remote_run(cfg, deployment)
    name = run_name or cfg.run.name
    layout = RunLayout(cfg.run.storage_root, name) if name else None
    if layout is not None and storage.exists(layout.run_info_url):  # a resume runs the stored topology
        check_topology(config_from_json_dict(layout.read_run_info().config), deployment)


def prepare(preset: str, overrides: List[str], run_name: str, workflow: str,
            deployment: Optional[TrainConfig] = None) -> RunSetup:
    """Check what the run needs (:func:`check_before_setup`; ``deployment``: the registered tasks'
    config in a remote execution, None in a local one), then load and check the config, validate
    prompts before any model loads, lay out the run, start the MLflow run; or resume ``run_name``
    (:func:`models.run.setup.setup_run`). A local execution holds the run's lock while it lasts."""
    check_before_setup(preset, overrides, run_name, workflow, deployment)
    setup = setup_run(preset, overrides, run_name, workflow)
    run_end.hold_if_local(setup.run.storage_root, setup.run.run_name, setup.run.mlflow_run_id, setup.cfg.run.lock_ttl_s,
                          setup.cfg.run.memory_limit_gib)
    return setup
