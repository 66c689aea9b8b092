"""Presets built on a base (``base:`` in models/config/io.py): merged key by key, refusals see the
base's keys as written, and a missing base or a cycle is an error naming the preset."""

from __future__ import annotations

import pytest

from models.config import ConfigError
from models.config.io import given_keys, load_config


def write(folder, name, text):
    path = folder / name
    path.write_text(text)
    return str(path)


def test_the_lora_preset_is_tiny_ppo_plus_its_own_keys():
    cfg = load_config("tiny_ppo_lora")  # base: tiny_ppo.yaml, whose base is base/tiny.yaml
    assert (cfg.actor.lr, cfg.actor.lora.rank, cfg.actor.lora.alpha, cfg.rollout.lora_mode) == (5e-4, 8, 16, "adapter")
    assert (cfg.critic.lr, cfg.actor.clip_eps, cfg.advantage.lam) == (1e-3, 0.2, 0.95)  # from tiny_ppo.yaml
    assert (cfg.rollout.prompts_per_iteration, cfg.run.num_iterations, cfg.actor.nproc_per_node) == (64, 40, 2)
    grpo = load_config("tiny_grpo")
    assert (grpo.kl.estimator, grpo.kl.placement, grpo.kl.coef) == ("k3", "loss", 0.04)  # over the base's k1


def test_nested_sections_merge_key_by_key(tmp_path):
    write(tmp_path, "parent.yaml", "actor:\n  lr: 0.001\n  lora:\n    rank: 8\n    alpha: 16\n")
    child = write(tmp_path, "child.yaml", "base: parent.yaml\nactor:\n  lora:\n    rank: 4\n")
    cfg = load_config(child)
    assert (cfg.actor.lr, cfg.actor.lora.rank, cfg.actor.lora.alpha) == (0.001, 4, 16)
    assert given_keys(child) == ["actor.lora.alpha", "actor.lora.rank", "actor.lr"]


def test_a_key_the_base_writes_counts_as_written(tmp_path):
    write(tmp_path, "parent.yaml", "advantage:\n  whiten: true\n")
    child = write(tmp_path, "child.yaml", "base: parent.yaml\nrun:\n  algorithm: grpo\n  \n")
    with pytest.raises(ConfigError, match="advantage.whiten=True is set, but run.algorithm=grpo does not use it"):
        load_config(child)


def test_a_missing_base_names_the_preset_and_the_base(tmp_path):
    child = write(tmp_path, "child.yaml", "base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"child.yaml: base 'nowhere.yaml' not found"):
        load_config(child)


def test_a_cycle_is_refused_with_the_chain(tmp_path):
    write(tmp_path, "a.yaml", "base: b.yaml\n")
    b = write(tmp_path, "b.yaml", "base: a.yaml\nrun:\n  seed: 1\n")
    with pytest.raises(ConfigError, match=r"b.yaml: base 'b.yaml' makes a cycle|a.yaml: base 'b.yaml' makes a cycle") as err:
        load_config(b)
    assert "a.yaml" in str(err.value) and "b.yaml ->" in str(err.value)
