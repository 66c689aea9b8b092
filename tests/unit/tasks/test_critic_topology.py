"""The critic update's elastic topology (``critic.nnodes``, ``critic.nproc_per_node``, ``critic.sharding``,
``critic.max_restarts``): its config checks, the presets with a full critic on several ranks, its launch
(``tasks/deploy.py``) and the cluster check of the registered topology."""

from __future__ import annotations

import dataclasses
import re

import pytest

from models.config import ActorConfig, ConfigError, CriticConfig
from models.config.io import load_config
from models.config.reference import missing_docstrings, rows
from models.config.topology import ElasticTopology
from tasks import deploy
from tasks.elastic import FORKSERVER

TOPOLOGY_FIELDS = ["nnodes", "nproc_per_node", "sharding", "max_restarts"]
TWO = ["critic.nproc_per_node=2", "critic.micro_batch_size=32"]
"""Two critic ranks on tiny_ppo (its 64-sample critic minibatch: 32 per rank)."""


def test_one_definition_of_the_topology_with_each_sections_defaults():
    for cls in (ActorConfig, CriticConfig):
        assert issubclass(cls, ElasticTopology)
        assert TOPOLOGY_FIELDS == [f.name for f in dataclasses.fields(cls)][:4]
    critic, actor = load_config("tiny_ppo").critic, ActorConfig()
    assert (critic.nnodes, critic.nproc_per_node, critic.sharding, critic.max_restarts, critic.world_size) == (
        1, 1, "auto", 1, 1)  # one process: the critic update as it was
    assert (actor.nnodes, actor.nproc_per_node, actor.world_size) == (1, 2, 2)
    docs = {key: doc for key, _, _, doc in rows(CriticConfig, "critic.")}
    assert "resources.critic_gpu" in docs["critic.nproc_per_node"] and "ddp" in docs["critic.sharding"]
    assert "resources.actor_gpu" in {key: doc for key, _, _, doc in rows(ActorConfig, "actor.")}["actor.nproc_per_node"]
    assert not missing_docstrings()


def test_critic_topology_keys_apply():
    cfg = load_config("tiny_ppo", ["critic.nnodes=2", "critic.nproc_per_node=2", "critic.sharding=fsdp2",
                                   "critic.max_restarts=0", "critic.micro_batch_size=4"])
    c = cfg.critic
    assert (c.nnodes, c.nproc_per_node, c.sharding, c.max_restarts, c.world_size) == (2, 2, "fsdp2", 0, 4)


@pytest.mark.parametrize("overrides, message", [
    (["critic.nproc_per_node=0"], "critic.nnodes and critic.nproc_per_node must be >= 1"),
    (["critic.nnodes=0"], "critic.nnodes and critic.nproc_per_node must be >= 1"),
    (["critic.sharding=zero3"], "critic.sharding='zero3' is not one of ['auto', 'fsdp2', 'ddp']"),
    (["critic.max_restarts=-1"], "critic.max_restarts must be >= 0"),
    (["actor.sharding=zero3"], "actor.sharding='zero3' is not one of ['auto', 'fsdp2', 'ddp']"),
    (["critic.nproc_per_node=2", "critic.micro_batch_size=32", "critic.remote_url=http://critic:8000"],
     "critic.nnodes × critic.nproc_per_node = 1 × 2 needs the critic inside the tasks"),
    (["critic.nproc_per_node=2", "resources.critic_gpu=1"],
     "resources.critic_gpu=1 must be 0 (CPU) or critic.nproc_per_node=2 (one GPU per process)"),
    (["critic.nproc_per_node=4", "critic.minibatch_size=16", "critic.micro_batch_size=8"],
     "critic.minibatch_size=16 must be divisible by critic.micro_batch_size × ranks = 8 × 4"),
    (["critic.minibatch_size=16", "critic.micro_batch_size=6"],
     "critic.minibatch_size=16 must be divisible by critic.micro_batch_size=6"),
])
def test_bad_critic_topology_is_named(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny_ppo", overrides)


def test_one_gpu_per_critic_process():
    cfg = load_config("tiny_ppo", ["critic.nproc_per_node=2", "critic.micro_batch_size=32", "resources.critic_gpu=2"])
    assert cfg.resources.critic_gpu == cfg.critic.nproc_per_node == 2


def test_the_8b_preset_offers_a_full_and_a_lora_critic():
    lora, full = load_config("llama8b_ppo_gpu"), load_config("llama8b_ppo_full_critic_gpu")
    assert lora.critic.lora.enabled and lora.critic.world_size == 1 == lora.resources.critic_gpu
    assert not full.critic.lora.enabled
    assert (full.critic.nnodes, full.critic.nproc_per_node, full.critic.sharding) == (1, 8, "fsdp2")
    assert full.critic.optimizer_state_sharded and full.resources.critic_gpu == 8
    assert dataclasses.replace(full, critic=lora.critic, resources=lora.resources) == lora  # only the critic differs


def test_the_70b_preset_validates_with_a_full_critic_on_several_nodes():
    base, full = load_config("llama70b_ppo_gpu"), load_config("llama70b_ppo_full_critic_gpu")
    c = full.critic
    assert not c.lora.enabled and "70b" in full.model.critic_path
    assert (c.nnodes, c.nproc_per_node, c.sharding, c.optimizer_state_sharded) == (8, 8, "fsdp2", True)
    assert full.resources.critic_gpu == c.nproc_per_node and full.resources.critic_mem == base.resources.actor_mem
    assert c.world_size == full.actor.world_size == 64  # NeMo-Aligner's 8 critic nodes beside 8 actor nodes


def test_the_critic_launch_is_its_own_topology():
    cfg = load_config("tiny_ppo", ["critic.nnodes=2", "critic.nproc_per_node=4", "critic.max_restarts=0",
                                   "critic.micro_batch_size=8"])
    e = deploy.elastic_for(cfg, section="critic")
    assert (e.nnodes, e.nproc_per_node, e.max_restarts, e.start_method) == (2, 4, 0, "spawn")
    a = deploy.elastic_for(cfg)  # the actor's stays the actor's
    assert (a.nnodes, a.nproc_per_node, a.max_restarts) == (1, 2, 1)


def test_one_critic_process_is_no_launch_registered_or_local():
    """The default (1 × 1) runs in the task's own process (``tasks/elastic.py``), as the critic always
    did; two local ranks come from the forkserver, two registered ones from the plugin's spawn."""
    one = load_config("tiny_ppo")
    for local in (False, True):
        e = deploy.elastic_for(one, local=local, section="critic")
        assert (e.nnodes, e.nproc_per_node, e.start_method) == (1, 1, FORKSERVER)
    two = load_config("tiny_ppo", TWO)
    assert deploy.elastic_for(two, local=True, section="critic").start_method == FORKSERVER
    assert deploy.elastic_for(two, section="critic").start_method == "spawn"


def test_use_local_topology_sets_the_critic_launch():
    from tasks.updates import critic_update

    registered = critic_update.task_config
    try:
        deploy.use_local_topology(critic_update, load_config("tiny_ppo", TWO), "critic")
        assert (critic_update.task_config.nproc_per_node, critic_update.task_config.start_method) == (2, FORKSERVER)
    finally:
        deploy.use_local_topology(critic_update, load_config("tiny_ppo"), "critic")
    assert critic_update.task_config.nproc_per_node == registered.nproc_per_node == 1


def test_cluster_runs_need_the_registered_critic_topology():
    registered = load_config("tiny_ppo")
    with pytest.raises(ConfigError, match=r"critic.nnodes × critic.nproc_per_node = 1 × 2, but the registered "
                                          r"critic_update runs 1 × 1"):
        deploy.check_topology(load_config("tiny_ppo", TWO), registered)
    deploy.check_topology(load_config("tiny_grpo"), registered)  # no critic: its topology is not asked


def test_registered_critic_update_is_one_process_by_default():
    """Without a deployment preset the critic update registers as one plain pod (no PyTorchJob), one
    process."""
    from flytekit.configuration import Image, ImageConfig, SerializationSettings
    from flytekit.tools.translator import get_serializable

    from tasks.updates import critic_update

    settings = SerializationSettings(image_config=ImageConfig(default_image=Image("default", "reg/img", "v1")))
    template = get_serializable({}, settings, critic_update).template
    assert template.type == "python-task" and critic_update.task_config.nproc_per_node == 1
