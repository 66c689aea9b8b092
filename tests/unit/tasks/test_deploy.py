"""Cluster settings from the config: per-task resources and GPU type, the actor's elastic topology,
and what the registered task templates say (compiled in-process, like ``pyflyte package`` does)."""

from __future__ import annotations

import pytest
from flytekit import Resources
from flytekit.configuration import Image, ImageConfig, SerializationSettings
from flytekit.tools.translator import get_serializable

from tasks import deploy
from models.config import ConfigError
from models.config.io import load_config

GPU = ["resources.rollout_gpu=1", "resources.rollout_mem=64Gi", "resources.accelerator=nvidia-h100",
       "resources.actor_gpu=2", "resources.actor_cpu=16"]


def test_resources_from_config():
    cfg = load_config("tiny_ppo", GPU)
    r = deploy.resources_for(cfg, "rollout")
    assert r["requests"] == r["limits"] == Resources(cpu="2", mem="64Gi", gpu="1", ephemeral_storage="10Gi")
    assert r["accelerator"].to_flyte_idl().device == "nvidia-h100"
    actor = deploy.resources_for(cfg, "actor")
    assert actor["requests"] == Resources(cpu="16", mem="8Gi", gpu="2", ephemeral_storage="10Gi")
    critic = deploy.resources_for(cfg, "critic")  # no GPU asked: no accelerator either
    assert critic["requests"] == Resources(cpu="2", mem="8Gi", ephemeral_storage="10Gi") and "accelerator" not in critic


def test_gpus_per_actor_node_match_processes():
    with pytest.raises(ConfigError, match="resources.actor_gpu=4 must be 0 .CPU. or actor.nproc_per_node=2"):
        load_config("tiny_ppo", ["resources.actor_gpu=4"])


def test_deployment_config_from_environment():
    cfg = deploy.read_deployment({deploy.DEPLOY_PRESET_ENV: "configs/llama8b_ppo_gpu.yaml",
                                  deploy.DEPLOY_OVERRIDES_ENV: "actor.nnodes=2 resources.accelerator=nvidia-l4"})
    assert (cfg.actor.nnodes, cfg.actor.nproc_per_node, cfg.resources.accelerator) == (2, 8, "nvidia-l4")
    e = deploy.elastic_for(cfg)
    assert (e.nnodes, e.nproc_per_node) == (2, 8)
    assert deploy.read_deployment({}) == load_config("")  # both unset: the defaults


def _deploy_reads(path) -> list:
    """Where ``path`` looks RLHF_DEPLOY_PRESET/RLHF_DEPLOY_OVERRIDES up (``environ.get(KEY)``,
    ``environ[KEY]``, ``getenv(KEY)``): the enclosing function's name, ``<module>`` outside any."""
    import ast

    def names_deploy(node) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("DEPLOY_PRESET_ENV", "DEPLOY_OVERRIDES_ENV")
                or isinstance(node, ast.Constant) and str(node.value).startswith("RLHF_DEPLOY_"))

    def visit(node, where: str):
        key = (node.args[0] if isinstance(node, ast.Call) and node.args else
               node.slice if isinstance(node, ast.Subscript) else None)
        if key is not None and names_deploy(key):
            yield where
        inner = node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
        for child in ast.iter_child_nodes(node):
            yield from visit(child, inner)

    return sorted(set(visit(ast.parse(path.read_text()), "<module>")))


def test_the_environment_is_read_in_one_place_once():
    """Only ``read_deployment`` looks RLHF_DEPLOY_PRESET/RLHF_DEPLOY_OVERRIDES up, called once (``REGISTERED``,
    what the task decorators are built from): no task module reads the environment for its settings."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[3]
    reads = {str(p.relative_to(root)): _deploy_reads(p) for folder in ("tasks", "workflows", "models")
             for p in sorted((root / folder).rglob("*.py"))}
    assert {p: r for p, r in reads.items() if r} == {"tasks/deploy.py": ["read_deployment"]}
    assert len(re.findall(r"read_deployment\(", (root / "tasks" / "deploy.py").read_text())) == 2  # def + call


def test_cluster_runs_need_the_registered_topology():
    registered = load_config("tiny_ppo")
    deploy.check_topology(load_config("tiny_ppo", ["actor.lr=1e-3"]), registered)  # same topology: fine
    with pytest.raises(ConfigError, match=r"1 × 1, but the registered actor_update runs 1 × 2"):
        deploy.check_topology(load_config("tiny_ppo", ["actor.nproc_per_node=1"]), registered)


def _template(entity):
    settings = SerializationSettings(image_config=ImageConfig(default_image=Image("default", "reg/img", "v1")))
    return get_serializable({}, settings, entity).template


def test_registered_defaults_are_the_tiny_cpu_settings():
    """Without a deployment preset the tasks register with the config defaults: one node (a plain
    pod running torch-elastic), no GPU; the rollout and score tasks publish decks."""
    from tasks.rollout import rollout
    from tasks.score import score
    from tasks.updates import actor_update

    actor = _template(actor_update)
    assert actor.type == "python-task"
    pod = actor.k8s_pod.pod_spec["containers"][0] if actor.k8s_pod else None
    res = pod["resources"]["requests"] if pod else {r.name: r.value for r in actor.container.resources.requests}
    assert "gpu" not in str(res).lower()
    assert _template(rollout).metadata.generates_deck and _template(score).metadata.generates_deck
    secrets = {s.key for s in _template(rollout).security_context.secrets}
    assert secrets == {"aws-access-key-id", "aws-secret-access-key", "server-token"}  # (the rollout service's)


def test_flyte_config_is_readable_by_pyflyte_and_holds_no_credentials():
    import configparser
    import os

    from flytekit.configuration import Config

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "flyte.config")
    cfg = Config.auto(path)
    assert (cfg.platform.endpoint, cfg.platform.insecure, cfg.platform.auth_mode) == ("flyte.example.com", False, "Pkce")
    ini = configparser.ConfigParser()
    ini.read(path)
    keys = {k for s in ini.sections() for k in ini[s]}
    assert not keys & {"access_key_id", "secret_access_key", "client_credentials_secret"}
