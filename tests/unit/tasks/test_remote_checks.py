"""What a remote run must have before ``prepare_run`` creates anything: no local paths (each named), a
tracking server that is not a local database and answers, S3 credentials; the git commit an image
was built from; disk in every heavy task's request."""

from __future__ import annotations

import pytest

from models.run import preflight

from models import tracking
from models.config import ConfigError
from models.config.io import load_config
from tests.processes import free_port

S3 = ["run.storage_root=s3://bucket/runs"]


@pytest.mark.parametrize("field", preflight.LOCAL_PATH_FIELDS)
def test_a_local_path_in_a_remote_run_is_refused_naming_the_field(field):
    overrides = S3 + ["reward.source=model", "reward.model_path=s3://bucket/rm"]
    overrides = [o for o in overrides if not o.startswith(field + "=")] + [f"{field}=/home/me/thing"]
    with pytest.raises(ConfigError, match=rf"^{field}='/home/me/thing': a local path in a remote execution"):
        preflight.check_remote_paths(load_config("tiny_ppo", overrides))


def test_object_storage_and_empty_fields_pass():
    preflight.check_remote_paths(load_config("tiny_ppo", S3 + ["model.actor_path=s3://b/m",
                                                              "data.train_prompts=s3://b/p"]))


@pytest.mark.parametrize("uri", ["", "sqlite:///mlflow.db", "file:///tmp/mlruns", "./mlruns"])
def test_a_local_tracking_uri_fails_a_remote_run_with_the_fix(uri, monkeypatch):
    monkeypatch.setenv(tracking.TRACKING_URI_ENV, uri)
    with pytest.raises(ConfigError, match=r"local to one pod in a remote execution.*make package MLFLOW_TRACKING_URI="):
        preflight.check_tracking(tracking.tracking_uri(), remote=True)
    preflight.check_tracking(tracking.tracking_uri(), remote=False)  # a local run keeps its local database


def test_an_unreachable_tracking_server_fails_at_once():
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ConfigError, match=rf"MLflow tracking server {uri} is not reachable from this pod"):
        preflight.check_tracking(uri, remote=False, timeout_s=5)


def test_a_local_artifact_location_fails_a_remote_run(monkeypatch):
    monkeypatch.setenv(tracking.ARTIFACT_LOCATION_ENV, "/data/mlruns")
    with pytest.raises(ConfigError, match="RLHF_MLFLOW_ARTIFACT_LOCATION='/data/mlruns' is local to one pod"):
        preflight.check_tracking("http://mlflow.example.com", remote=True)


def test_s3_runs_without_credentials_name_the_secret(monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask
    with pytest.raises(ConfigError, match="no S3 credentials .* flyte-rlhf/aws-access-key-id, flyte-rlhf/aws-secret"):
        preflight.check_s3_credentials(load_config("tiny_ppo", S3))
    preflight.check_s3_credentials(load_config("tiny_ppo"))  # local storage needs none
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    preflight.check_s3_credentials(load_config("tiny_ppo", S3))


def test_the_topology_is_checked_with_the_rest():
    with pytest.raises(ConfigError, match=r"1 × 1, but the registered actor_update runs 1 × 2"):
        preflight.check_remote_run(load_config("tiny_ppo", S3 + ["actor.nproc_per_node=1"]), load_config("tiny_ppo"))


def test_a_resident_run_on_several_nodes_needs_a_cluster(monkeypatch):
    """A local resident run's services are child processes on this machine: a trainer of several nodes is
    refused there, naming the field; on a cluster (its services nodes of the execution) the same config passes
    every check (here up to the tracking server's, which is last)."""
    cfg = load_config("tiny_ppo", S3 + ["actor.nnodes=2", "actor.nproc_per_node=1", "run.resident=true"])
    with pytest.raises(ConfigError, match=r"actor.nnodes=2: a local run.resident=true run starts its services on "
                                          r"this machine.*pyflyte run --remote"):
        preflight.check_local_resident(cfg)
    with pytest.raises(ConfigError, match=r"critic.nnodes=2"):
        preflight.check_local_resident(load_config("tiny_ppo", ["run.resident=true", "critic.nnodes=2",
                                                                "critic.micro_batch_size=32"]))
    preflight.check_local_resident(load_config("tiny_ppo", ["run.resident=true"]))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv(tracking.TRACKING_URI_ENV, "sqlite:///mlflow.db")
    with pytest.raises(ConfigError, match=r"local to one pod in a remote execution"):
        preflight.check_remote_run(cfg, load_config("tiny_ppo", ["actor.nnodes=2", "actor.nproc_per_node=1"]))


def test_the_image_commit_wins_over_git(monkeypatch):
    from models.run.setup import GIT_COMMIT_ENV, git_commit

    monkeypatch.setenv(GIT_COMMIT_ENV, "0123abcd")
    assert git_commit() == "0123abcd"
    monkeypatch.setenv(GIT_COMMIT_ENV, "unknown")  # the Dockerfile's default: ask git
    assert git_commit() not in ("unknown", "0123abcd") and len(git_commit()) == 40


def test_every_heavy_task_requests_its_disk():
    from tasks.deploy import resources_for

    cfg = load_config("llama8b_ppo_gpu")
    for task, disk in (("rollout", "80Gi"), ("score", "160Gi"), ("actor", "200Gi"), ("critic", "80Gi")):
        r = resources_for(cfg, task)
        assert r["requests"].ephemeral_storage == r["limits"].ephemeral_storage == disk
    with pytest.raises(ConfigError, match="resources.score_disk must not be empty"):
        load_config("tiny_ppo", ["resources.score_disk= "])
