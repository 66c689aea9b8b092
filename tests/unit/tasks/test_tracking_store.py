"""A new local MLflow store (``sqlite:///...``) starts as a copy of an empty one MLflow made and migrated before
(``models.tracking.seed_sqlite_store``): the same schema and contents as a store MLflow creates itself, never laid
over a store that exists, and MLflow's own creation still there when the cache cannot be written."""

from __future__ import annotations

import sqlite3

import pytest

from models import tracking


def _schema(path) -> tuple:
    """The store's tables, its schema version (Alembic's) and its experiments. A table is its columns in order
    (SQLite's table_info) and the lines of its SQL as a set: Alembic's batch migrations rewrite a table with its
    constraints in set order, so two stores MLflow makes itself list the same CHECKs in either order (PYTHONHASHSEED).
    (Indexes are left out: MLflow adds some as a store is used, so a used store has more than a new one.)"""
    with sqlite3.connect(path) as db:
        tables = [
            (name, db.execute(f"PRAGMA table_info('{name}')").fetchall(),
             sorted(line.strip().rstrip(",") for line in sql.splitlines()))
            for name, sql in db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table' ORDER BY name")
        ]
        version = db.execute("SELECT version_num FROM alembic_version").fetchall()
        experiments = db.execute("SELECT experiment_id, name, lifecycle_stage FROM experiments").fetchall()
    return tables, version, experiments


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_seeded_store_is_the_store_mlflow_makes_and_takes_a_run(tmp_path, cache, monkeypatch):
    from mlflow.tracking import MlflowClient

    made = tmp_path / "made.db"
    MlflowClient(tracking_uri=f"sqlite:///{made}").search_experiments()  # MLflow's own creation, the reference
    seeded = tmp_path / "runs" / "mlflow.db"
    seeded.parent.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{seeded}")
    run_id = tracking.start_run("seeded", "r", {"a": 1}, {"t": "x"})
    template = cache / f"mlflow-{__import__('mlflow').__version__}.db"
    assert list(cache.iterdir()) == [template]
    assert sorted(p.name for p in seeded.parent.iterdir()) == ["mlflow.db"]  # no copy left behind
    assert _schema(template) == _schema(made)  # what a new store starts from: the store MLflow makes
    tables, version, _ = _schema(seeded)
    assert (tables, version) == _schema(made)[:2] and len(tables) > 10
    assert tracking.log_metrics(run_id, {"x": 1.0}, step=0) == 1
    assert tracking.client().get_run(run_id).data.params == {"a": "1"}


def test_an_existing_store_is_kept_as_it_is(tmp_path, cache, monkeypatch):
    store = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    run_id = tracking.start_run("kept", "r", {}, {})
    tracking.seed_sqlite_store(f"sqlite:///{store}")
    assert tracking.client().get_run(run_id).info.run_name == "r"


def test_an_unwritable_cache_leaves_the_creation_to_mlflow(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache folder would go
    monkeypatch.setenv("RLHF_CACHE_DIR", str(blocked / "cache"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    run_id = tracking.start_run("plain", "r", {}, {})
    assert tracking.client().get_run(run_id).info.status == "RUNNING"


def test_only_sqlite_paths_are_seeded():
    assert tracking.sqlite_path("sqlite:///mlflow.db") == "mlflow.db"
    assert tracking.sqlite_path("sqlite:////abs/m.db") == "/abs/m.db"
    assert tracking.sqlite_path("http://127.0.0.1:5000") is None and tracking.sqlite_path("sqlite:///") is None


def test_a_sqlite_store_keeps_its_artifacts_beside_it(tmp_path, cache, monkeypatch):
    """A new experiment of a SQLite store in another folder (each test's and benchmark's) keeps a run's artifacts in
    ``mlruns`` beside the database, not in MLflow's default ``./mlruns`` under the working directory (where
    registered models piled up in the checkout); ``RLHF_MLFLOW_ARTIFACT_LOCATION`` still wins."""
    store, cwd, chosen = tmp_path / "store", tmp_path / "cwd", tmp_path / "chosen"
    store.mkdir()
    cwd.mkdir()
    monkeypatch.setenv(tracking.TRACKING_URI_ENV, f"sqlite:///{store}/mlflow.db")
    monkeypatch.delenv(tracking.ARTIFACT_LOCATION_ENV, raising=False)
    monkeypatch.chdir(cwd)
    run_id = tracking.start_run("bench", "r", {"a": 1})
    tracking.client().log_text(run_id, "hello", "notes/n.txt")
    assert [p.read_text() for p in (store / "mlruns").rglob("n.txt")] == ["hello"]
    assert not list(cwd.iterdir())  # no ./mlruns
    monkeypatch.setenv(tracking.ARTIFACT_LOCATION_ENV, str(chosen))
    run_id = tracking.start_run("another", "r", {"a": 1})
    tracking.client().log_text(run_id, "there", "notes/m.txt")
    assert [p.read_text() for p in chosen.rglob("m.txt")] == ["there"]
