"""``make package`` (``pyflyte package``, offline) for a 2-node GPU deployment: the compiled task
templates carry the image, the resources and GPU type of the preset, the actor and the critic updates
(and the score on the actor's ranks) are PyTorch jobs with their elastic settings, and the nightly launch
plan has its schedule and defaults."""

from __future__ import annotations

import glob
import os
import tarfile

import pytest
import yaml
from flyteidl.admin import launch_plan_pb2, task_pb2
from google.protobuf.json_format import MessageToDict

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMAGE = "registry.example.com/flyte-rlhf:test"
PRESET = "configs/llama8b_ppo_gpu.yaml"
HEAVY = {"tasks.rollout.rollout": "rollout", "tasks.score.score": "score", "tasks.score.score_ranks": "score",
         "tasks.updates.actor_update": "actor",
         "tasks.updates.critic_update": "critic", "tasks.iteration.evaluate": "rollout",
         "tasks.retrain.promote_if_better": "rollout", "tasks.services.engine_service": "rollout",
         "tasks.services.actor_service": "actor", "tasks.services.critic_service": "critic"}


TRACKING = "https://mlflow.example.com"
DEPLOY_OVERRIDES = "actor.nnodes=2 critic.nnodes=2"
"""The preset's actor (8 ranks a node) and LoRA critic (one rank a node) each on two nodes."""


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    from tests.cluster.package import build_package

    out = tmp_path_factory.mktemp("pkg")
    tgz = build_package(out, IMAGE, PRESET, DEPLOY_OVERRIDES, {"MLFLOW_TRACKING_URI": TRACKING})
    with tarfile.open(tgz) as tar:
        tar.extractall(out / "x")
    return out / "x"


def _read(path, cls):
    msg = cls()
    with open(path, "rb") as f:
        msg.ParseFromString(f.read())
    return MessageToDict(msg)


def _tasks(root):
    return {t["template"]["id"]["name"]: t["template"] for t in
            (_read(p, task_pb2.TaskSpec) for p in glob.glob(f"{root}/*_1.pb"))}


def _container(template):
    """The primary container: the plain one, or the one in the task's pod spec (elastic tasks)."""
    if "container" in template:
        c = template["container"]
        return c["image"], {r["name"].lower(): r["value"] for r in c.get("resources", {}).get("requests", [])}
    pod = template["k8sPod"]["podSpec"]["containers"][0]
    return pod["image"], {k.replace("memory", "mem"): v for k, v in pod["resources"]["requests"].items()}


def test_every_task_runs_the_image_with_the_presets_resources(package):
    with open(os.path.join(ROOT, PRESET)) as f:
        res = yaml.safe_load(f)["resources"]
    tasks = _tasks(package)
    assert set(HEAVY) <= set(tasks)
    for name, template in tasks.items():
        image, requests = _container(template)
        assert image == IMAGE, name
        if name in HEAVY:
            key = HEAVY[name]
            want = {"cpu": str(res[f"{key}_cpu"]), "mem": res[f"{key}_mem"], "gpu": str(res[f"{key}_gpu"]),
                    "ephemeral_storage": res[f"{key}_disk"]}
            got = {k.replace("memory", "mem").replace("-", "_"): v for k, v in requests.items()}
            assert got == want, name
            assert template["extendedResources"]["gpuAccelerator"]["device"] == res["accelerator"], name
        elif name.startswith("tasks."):
            assert "gpu" not in requests, name


def _elastic_job(package, name: str, module: str = "updates"):
    """``(min nodes, max nodes, processes per node, worker pods)`` of task ``name`` (an update by default), a
    PyTorchJob with torch-elastic's c10d rendezvous."""
    template = _tasks(package)[f"tasks.{module}.{name}"]
    assert template["type"] == "pytorch"
    elastic = template["custom"]["elasticConfig"]
    assert elastic["rdzvBackend"] == "c10d"
    return (elastic["minReplicas"], elastic["maxReplicas"], elastic["nprocPerNode"],
            template["custom"]["workerReplicas"]["replicas"])


def test_actor_update_is_an_elastic_pytorch_job(package):
    assert _elastic_job(package, "actor_update") == (2, 2, 8, 2)
    assert _elastic_job(package, "actor_service", "services") == (2, 2, 8, 2)  # a resident run's actor trainer


def test_critic_update_is_an_elastic_pytorch_job_of_its_own_topology(package):
    assert _elastic_job(package, "critic_update") == (2, 2, 1, 2)
    assert _elastic_job(package, "critic_service", "services") == (2, 2, 1, 2)


def test_score_on_ranks_is_an_elastic_pytorch_job_of_the_actors_topology(package):
    """``actor.score_on_ranks`` runs ``score_ranks`` on the registered actor topology; ``score`` stays one pod."""
    assert _elastic_job(package, "score_ranks", "score") == (2, 2, 8, 2)
    assert _tasks(package)["tasks.score.score"]["type"] == "python-task"


def test_secrets_are_requested_never_inputs(package):
    tasks = _tasks(package)
    keys = {s["key"] for s in tasks["tasks.run_tasks.prepare_run"]["securityContext"]["secrets"]}
    assert keys == {"aws-access-key-id", "aws-secret-access-key", "mlflow-tracking-token"}
    assert {s["group"] for t in tasks.values() for s in t.get("securityContext", {}).get("secrets", [])} \
        == {"flyte-rlhf"}
    for name, template in tasks.items():
        inputs = " ".join(template["interface"].get("inputs", {}).get("variables", {})).lower()
        assert not any(w in inputs for w in ("token", "secret", "password", "key")), name


def test_nightly_launch_plan_schedule_and_defaults(package):
    from workflows.retrain import NIGHTLY_DEFAULTS

    (path,) = glob.glob(f"{package}/*_retrain_nightly_3.pb")
    lp = _read(path, launch_plan_pb2.LaunchPlan)
    spec = lp["spec"]
    assert spec["workflowId"]["name"] == "workflows.retrain.retrain"
    assert spec["entityMetadata"]["schedule"] == {"cronSchedule": {"schedule": "0 3 * * *"},
                                                  "kickoffTimeInputArg": "run_date"}
    params = spec["defaultInputs"]["parameters"]
    assert set(params) == set(NIGHTLY_DEFAULTS) | {"run_date"}
    assert all("default" in p for p in params.values())  # nothing required: the schedule can start it alone
    prim = lambda name: params[name]["default"]["scalar"]["primitive"]  # noqa: E731
    assert prim("prompts_root")["stringValue"] == NIGHTLY_DEFAULTS["prompts_root"]
    assert prim("min_improvement")["floatValue"] == pytest.approx(NIGHTLY_DEFAULTS["min_improvement"])
    overrides = [x["scalar"]["primitive"]["stringValue"] for x in params["overrides"]["default"]["collection"]["literals"]]
    assert overrides == NIGHTLY_DEFAULTS["overrides"]


def test_every_task_carries_the_registration_settings(package):
    """``make package MLFLOW_TRACKING_URI=...`` puts the tracking server and the deployment the tasks were
    compiled with into every task's container (what ``pyflyte register|run --remote --env`` do too)."""
    for name, template in _tasks(package).items():
        c = template.get("container") or template["k8sPod"]["podSpec"]["containers"][0]
        env = {kv["key"]: kv["value"] for kv in c.get("env", [])}
        assert env["MLFLOW_TRACKING_URI"] == TRACKING, name
        assert (env["RLHF_DEPLOY_PRESET"], env["RLHF_DEPLOY_OVERRIDES"]) == (PRESET, DEPLOY_OVERRIDES), name
