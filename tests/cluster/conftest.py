"""Fixtures of the pod-level harness: a pretend cluster on the moto S3 server (metadata bucket, run
storage), ``mlflow server`` on 127.0.0.1, packages compiled with ``make package``'s command for a
given deployment, and the image environment from the ``Dockerfile``."""

from __future__ import annotations

import functools
import subprocess
import uuid
from pathlib import Path
from typing import Dict, Mapping

import pytest

from tests.cluster.harness import Cluster
from tests.cluster.literals import ObjectStore
from tests.cluster.package import ROOT, build_package, image_env, load_package
from tests.cluster.pods import PodSettings
from tests.conftest import BUCKET
from tests.processes import mlflow_server

IMAGE = "registry.example.com/flyte-rlhf:harness"
DEPLOY = ("configs/tiny_ppo.yaml", "actor.nnodes=2 actor.nproc_per_node=2 actor.micro_batch_size=4 "
                                   "critic.nnodes=2 critic.nproc_per_node=1 critic.micro_batch_size=32")
"""The deployment every package of these tests is compiled with: the actor update a two-node PyTorchJob
of 2 ranks per node, the critic update one of two pods of one rank."""
TOPOLOGY = ["actor.nnodes=2", "actor.nproc_per_node=2", "actor.micro_batch_size=4"]
"""Overrides that give a run the registered actor topology."""
CRITIC_TOPOLOGY = ["critic.nnodes=2", "critic.nproc_per_node=1"]
"""... and a PPO run the registered critic topology (a critic-free run refuses the critic's options)."""
PPO_TOPOLOGY = TOPOLOGY + CRITIC_TOPOLOGY + ["critic.micro_batch_size=32"]
"""The registered topologies for the preset's batch sizes (its critic minibatch of 64 over 2 ranks)."""
KEY = SECRET = "testing"
"""The moto server's (dummy) credentials: the cluster's Kubernetes secrets hold them."""


def head_commit() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="session")
def mlflow_url(tmp_path_factory):
    """A tracking server every pod and local run of the session reports to."""
    with mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as url:
        yield url


def cluster_secrets(**extra: str) -> Dict[tuple, str]:
    """The Kubernetes secret ``flyte-rlhf`` of the pretend cluster."""
    from tasks import secrets

    out = {(secrets.GROUP, "aws-access-key-id"): KEY, (secrets.GROUP, "aws-secret-access-key"): SECRET,
           (secrets.GROUP, "service-secret"): "pretend-cluster-service-secret"}  # a resident run's services
    out.update({(secrets.GROUP, k.replace("_", "-")): v for k, v in extra.items()})
    return out


def registration_env(s3_endpoint: str, mlflow: str) -> Dict[str, str]:
    """What ``make package`` is told for this cluster (``--env``): the tracking server, the
    S3-compatible endpoint of the run storage."""
    return {"MLFLOW_TRACKING_URI": mlflow, "AWS_ENDPOINT_URL": s3_endpoint, "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def packages(tmp_path_factory):
    """``packages(deploy_overrides, env)`` → the loaded package, built once per distinct arguments."""
    @functools.lru_cache(maxsize=None)
    def build(preset: str, overrides: str, env: tuple):
        out = tmp_path_factory.mktemp("package")
        return load_package(build_package(out, IMAGE, preset, overrides, dict(env)))

    return lambda preset, overrides, env: build(preset, overrides, tuple(sorted(env.items())))


def new_cluster(package, s3_server: str, pods_root: Path, baked: Path, secrets: Mapping = None,
                cluster_env: Mapping = (), **kw) -> Cluster:
    """A :class:`Cluster` whose pods live under ``pods_root``, metadata and raw outputs on the moto server
    ``s3_server``; ``baked``: the folder of the caches an image would carry prebuilt."""
    from models.demos.builders import cache_dir

    env = image_env(ROOT / "Dockerfile", {"GIT_COMMIT": head_commit(), "DEPLOY_PRESET": "", "DEPLOY_OVERRIDES": ""})
    # Content-keyed caches an image would carry prebuilt (the demo's warm-started models, matplotlib's
    # fonts, the kernels vLLM's CPU backend compiles: 1-2 min per cold pod here); one torch thread
    # per pod (each node limited to one core).
    env.update(RLHF_CACHE_DIR=cache_dir(), MPLCONFIGDIR=str(baked / "matplotlib"), OMP_NUM_THREADS="1",
               TORCHINDUCTOR_CACHE_DIR=str(baked / "inductor"), VLLM_CACHE_ROOT=str(baked / "vllm"),
               TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error", VLLM_LOGGING_LEVEL="WARNING")
    store = ObjectStore(s3_server, KEY, SECRET)
    prefix = f"s3://{BUCKET}/cluster-{uuid.uuid4().hex[:8]}"
    # Propeller's default variables: its metadata bucket's endpoint and keys; no instance metadata
    # service on this cluster (botocore would look for one outside the loopback network).
    # A resident run's service pods listen and publish on loopback (models/hosts/resident.py).
    default = {"FLYTE_AWS_ENDPOINT": s3_server, "FLYTE_AWS_ACCESS_KEY_ID": KEY,
               "FLYTE_AWS_SECRET_ACCESS_KEY": SECRET, "AWS_EC2_METADATA_DISABLED": "true",
               "RLHF_SERVICE_HOST": "127.0.0.1"}
    pods = PodSettings(root=pods_root, image_env=env, cluster_env={**default, **dict(cluster_env)},
                       secrets=cluster_secrets() if secrets is None else secrets,
                       pin_cores=kw.pop("pin_cores", ()))
    return Cluster(package, store, f"{prefix}/metadata", f"{prefix}/raw", pods, **kw)


@pytest.fixture
def make_cluster(s3_server, tmp_path, tmp_path_factory):
    """``make_cluster(package, secrets=..., cluster_env=..., pin_cores=..., parallelism=...)`` → a
    :class:`Cluster` whose pods live under this test's folder; metadata and raw outputs on the moto server."""
    baked = tmp_path_factory.getbasetemp() / "image-baked"  # what the image would carry prebuilt
    return lambda package, **kw: new_cluster(package, s3_server, Path(tmp_path) / "pods", baked, **kw)
