"""MLflow helpers: one run per training run, addressed by run id from every task.

Tracking URI from ``MLFLOW_TRACKING_URI`` (local default ``sqlite:///mlflow.db``, which
``mlflow ui --backend-store-uri sqlite:///mlflow.db`` opens). Logging is idempotent per step,
so a resumed run continues the same MLflow run without duplicated steps.

The package also holds :mod:`models.tracking.registry` (the MLflow model registry),
:mod:`models.tracking.report` (reward curves from a run) and :mod:`models.tracking.redact`
(secrets kept out of what is logged).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional

from models.tracking.redact import redact

log = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
_MAX_PARAM_LEN = 6000


TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
ARTIFACT_LOCATION_ENV = "RLHF_MLFLOW_ARTIFACT_LOCATION"
"""Where a new experiment keeps its artifacts (empty: the tracking server's default)."""
LOCAL_SCHEMES = ("", "file", "sqlite")
"""Tracking URIs that name this machine's disk: every pod of a remote run would get its own."""


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` (empty or unset: :data:`DEFAULT_TRACKING_URI`). A remote run gets it
    from the registration (``make package MLFLOW_TRACKING_URI=...``, ``pyflyte register/run --remote
    --env``), which puts it into every task's container."""
    return os.environ.get(TRACKING_URI_ENV) or DEFAULT_TRACKING_URI


def artifact_location() -> Optional[str]:
    """Artifact location of experiments this project creates (:data:`ARTIFACT_LOCATION_ENV`), else None."""
    return os.environ.get(ARTIFACT_LOCATION_ENV) or None


def new_experiment_location() -> Optional[str]:
    """Where a new experiment keeps its artifacts: :func:`artifact_location`; else, for a SQLite store, ``mlruns``
    beside its database file (MLflow's own default is ``./mlruns`` under the working directory, so every store a
    test or benchmark made in a folder of its own left its registered models in the checkout: 1.2 GB a run at
    Qwen3-0.6B's shape, 57 GB by 2026-11-30; for ``sqlite:///mlflow.db`` in the working directory the two agree);
    else the tracking server's default (None)."""
    path = sqlite_path(tracking_uri())
    if artifact_location() or path is None:
        return artifact_location()
    return os.path.join(os.path.dirname(os.path.abspath(path)), "mlruns")


def is_local_uri(uri: str) -> bool:
    """True for a tracking URI or artifact location on this machine's disk (``sqlite:``, ``file:``, a path)."""
    from urllib.parse import urlsplit

    return urlsplit(uri).scheme.lower() in LOCAL_SCHEMES


def client():
    import mlflow
    from mlflow.tracking import MlflowClient

    seed_sqlite_store(tracking_uri())
    mlflow.set_tracking_uri(tracking_uri())
    return MlflowClient(tracking_uri=tracking_uri())


def sqlite_path(uri: str) -> Optional[str]:
    """The database file of a ``sqlite:///`` tracking URI (relative to the working directory with three slashes,
    absolute with four), else None."""
    return uri[len("sqlite:///"):] or None if uri.startswith("sqlite:///") else None


def seed_sqlite_store(uri: str) -> None:
    """A local store that does not exist yet starts as a copy of an empty one MLflow made and migrated before
    (``<cache_dir>/mlflow-<version>.db``, made once per machine and MLflow version): creating a store runs every
    schema migration of MLflow's history, about 4 s of CPU a new ``mlflow.db`` (each test's, a user's first run in a
    folder). The copy is linked into place, so a store another process made first is kept as it is."""
    import shutil

    path = sqlite_path(uri)
    if path is None or os.path.exists(path):
        return
    tmp = f"{path}.{os.getpid()}.seed"
    try:
        shutil.copyfile(_empty_store(), tmp)
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process of the run made it meanwhile
    except Exception as err:  # noqa: BLE001 -- an unwritable cache or folder: MLflow makes the store itself
        log.debug("no seeded MLflow store at %s: %s", path, err)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _empty_store() -> str:
    import mlflow
    from mlflow.tracking import MlflowClient

    from models.environ import cache_dir

    template = os.path.join(cache_dir(), f"mlflow-{mlflow.__version__}.db")
    if not os.path.exists(template):
        os.makedirs(os.path.dirname(template), exist_ok=True)
        made = f"{template}.{os.getpid()}.tmp"
        MlflowClient(tracking_uri=f"sqlite:///{os.path.abspath(made)}").search_experiments()  # creates, migrates
        os.replace(made, template)  # whole or not at all; a concurrent maker's copy is the same
    return template


def start_run(experiment: str, run_name: str, params: Mapping[str, Any],
              tags: Optional[Mapping[str, str]] = None) -> str:
    """Create the run (experiment created if missing), log params, return the run id."""
    c = client()
    exp = c.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp is not None else c.create_experiment(
        experiment, artifact_location=new_experiment_location())
    run = c.create_run(exp_id, run_name=run_name, tags={k: redact(str(v)) for k, v in (tags or {}).items()})
    log_params(run.info.run_id, params)
    return run.info.run_id


def log_params(run_id: str, params: Mapping[str, Any]) -> None:
    from mlflow.entities import Param

    items = [Param(k, redact(str(v))[:_MAX_PARAM_LEN]) for k, v in sorted(params.items())]  # no credentials
    c = client()
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i:i + 100])


NONFINITE_PREFIX = "nonfinite/"
"""``nonfinite/<key>`` is 1 at every step where metric ``<key>`` was NaN or infinite."""


def log_metrics(run_id: str, metrics: Mapping[str, float], step: int) -> int:
    """Log ``metrics`` at ``step``; keys already logged at that step are skipped. Returns count logged.

    A NaN or infinite value is logged as it is (MLflow keeps NaN and stores ±inf as ±1.8e308), with
    the flag metric ``nonfinite/<key>`` = 1 at that step and the tag ``nonfinite.<key>`` naming the
    value and step, so a chart never looks clean by omission."""
    import time

    from mlflow.entities import Metric, RunTag

    c = client()
    ts = int(time.time() * 1000)
    todo, tags = [], []
    latest = latest_steps(run_id)
    for k, v in sorted(metrics.items()):
        if v is None or (latest.get(k, step - 1) >= step and logged_at(run_id, k, step)):
            continue
        todo.append(Metric(k, float(v), ts, step))
        if not math.isfinite(float(v)):
            log.warning("metric %s is %s at step %d", k, v, step)
            todo.append(Metric(NONFINITE_PREFIX + k, 1.0, ts, step))
            tags.append(RunTag(f"nonfinite.{k}", f"{float(v)} at step {step}"))
    for i in range(0, len(todo), 200):
        c.log_batch(run_id, metrics=todo[i:i + 200])
    if tags:
        c.log_batch(run_id, tags=tags)
    return len(todo)


def latest_steps(run_id: str) -> Dict[str, int]:
    """The step of each metric's latest value in the run (one ``get_run``; MLflow keeps a metric's value at
    its highest step beside its history). A key's history is read only when this step is not below the one
    being logged (a commit redone after a crash), so logging costs the same at iteration 10 and 10,000."""
    return {m.key: m.step for m in client().get_run(run_id).to_proto().data.metrics}


def logged_at(run_id: str, key: str, step: int) -> bool:
    return step in {m.step for m in client().get_metric_history(run_id, key)}


def log_table(run_id: str, columns: Dict[str, List[Any]], artifact_file: str) -> None:
    """A table the MLflow UI shows in its artifact and evaluation views (``mlflow.log_table``).

    Logged once per ``artifact_file``: MLflow appends to an existing table, so a retried or
    resumed commit would duplicate its rows."""
    c = client()
    if any(a.path == artifact_file for a in c.list_artifacts(run_id, os.path.dirname(artifact_file) or None)):
        return
    _make_room_in_table_list(c, run_id, artifact_file)
    c.log_table(run_id, data=columns, artifact_file=artifact_file)


_TABLE_LIST_TAG = "mlflow.loggedArtifacts"
_MAX_TAG_LEN = 8000


def _make_room_in_table_list(c, run_id: str, artifact_file: str) -> None:
    """MLflow lists a run's tables in one tag of at most 8000 characters (about 150 tables): drop
    the oldest entries so the next one fits. Their files stay; the UI shows them as plain JSON."""
    import json

    tables = json.loads(c.get_run(run_id).data.tags.get(_TABLE_LIST_TAG, "[]"))
    kept = list(tables)
    while kept and len(json.dumps(kept + [{"path": artifact_file, "type": "table"}])) > _MAX_TAG_LEN:
        kept.pop(0)
    if len(kept) < len(tables):
        c.set_tag(run_id, _TABLE_LIST_TAG, json.dumps(kept))


def set_tags(run_id: str, tags: Mapping[str, str]) -> None:
    c = client()
    for k, v in tags.items():
        c.set_tag(run_id, k, redact(str(v)))


def end_run(run_id: str, status: str = "FINISHED") -> None:
    client().set_terminated(run_id, status=status)


def metric_history(run_id: str, key: str) -> List[tuple]:
    """``[(step, value), ...]`` sorted by step."""
    return sorted((m.step, m.value) for m in client().get_metric_history(run_id, key))


def run_metric_keys(run_id: str) -> Iterable[str]:
    return client().get_run(run_id).data.metrics.keys()
