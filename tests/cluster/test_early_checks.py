"""A remote run that cannot work fails in its first pod, ``prepare_run``, before it creates anything
(no object under the storage root, no MLflow run), with the field or setting named and the fix; a
non-recoverable error is not retried. Each case is the package as ``make package`` compiles it, run
by the harness's pods."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import DEPLOY, PPO_TOPOLOGY, cluster_secrets, registration_env
from tests.conftest import BUCKET
from tests.processes import free_port

pytestmark = pytest.mark.integration

S3_ONLY = {"AWS_DEFAULT_REGION": "us-east-1"}


def run_prepare(cluster, root: str, extra=tuple(PPO_TOPOLOGY)):
    ex = cluster.execute("workflows.ppo.ppo_training",
                         {"preset": "configs/tiny_ppo.yaml", "overrides": [f"run.storage_root={root}", *extra],
                          "run_name": "early"})
    assert ex.error and [a.task for a in ex.attempts] == ["tasks.run_tasks.prepare_run"]  # failed once, no retry
    return ex.error


def nothing_created(cluster, root: str) -> bool:
    return not cluster.store.fs().exists(root.removeprefix("s3://"))


@pytest.fixture
def bare(packages, s3_server):
    """The package registered without a tracking server (only the S3 endpoint)."""
    return packages(*DEPLOY, {"AWS_ENDPOINT_URL": s3_server, **S3_ONLY})


def test_no_tracking_server_fails_first_with_the_fix(bare, make_cluster, tmp_path):
    root = f"s3://{BUCKET}/early-{tmp_path.name}"
    error = run_prepare(make_cluster(bare), root)
    assert "MLflow tracking URI 'sqlite:///mlflow.db' is local to one pod" in error
    assert "make package MLFLOW_TRACKING_URI=" in error and nothing_created(make_cluster(bare), root)


def test_an_unreachable_tracking_server_fails_first(bare, make_cluster, tmp_path):
    root = f"s3://{BUCKET}/early-{tmp_path.name}"
    uri = f"http://127.0.0.1:{free_port()}"  # set cluster-wide (propeller's default-env-vars): nobody listens
    cluster = make_cluster(bare, cluster_env={"MLFLOW_TRACKING_URI": uri})
    assert f"MLflow tracking server {uri} is not reachable from this pod" in run_prepare(cluster, root)
    assert nothing_created(cluster, root)


@pytest.fixture
def full(packages, s3_server, mlflow_url):
    return packages(*DEPLOY, registration_env(s3_server, mlflow_url))


def _no_mlflow_run(mlflow_url: str, root: str) -> bool:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_url)
    exp = client.get_experiment_by_name("flyte-rlhf")
    return exp is None or not client.search_runs([exp.experiment_id], f"tags.storage LIKE '{root}/%'")


def test_a_local_storage_root_is_refused_naming_the_field(full, make_cluster, tmp_path, mlflow_url):
    error = run_prepare(make_cluster(full), str(tmp_path / "runs"))
    assert f"run.storage_root='{tmp_path / 'runs'}': a local path in a remote execution" in error
    assert not (tmp_path / "runs").exists() and _no_mlflow_run(mlflow_url, str(tmp_path / "runs"))


def test_a_topology_other_than_the_registered_one_fails_first(full, make_cluster, tmp_path, mlflow_url):
    root = f"s3://{BUCKET}/early-{tmp_path.name}"
    error = run_prepare(make_cluster(full), root, ["actor.nproc_per_node=1"])  # the preset's 1 node
    assert "actor.nnodes × actor.nproc_per_node = 1 × 1, but the registered actor_update runs 2 × 2" in error
    assert nothing_created(make_cluster(full), root) and _no_mlflow_run(mlflow_url, root)


def test_missing_s3_secrets_are_named(full, make_cluster, tmp_path, mlflow_url):
    root = f"s3://{BUCKET}/early-{tmp_path.name}"
    cluster = make_cluster(full, secrets={k: v for k, v in cluster_secrets().items() if k[1] != "aws-access-key-id"})
    error = run_prepare(cluster, root)
    assert "no S3 credentials in this pod" in error and "flyte-rlhf/aws-access-key-id" in error
    assert nothing_created(cluster, root) and _no_mlflow_run(mlflow_url, root)
