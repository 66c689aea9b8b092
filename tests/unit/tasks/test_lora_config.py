"""LoRA settings: off by default, nested ``actor.lora.*`` overrides, bad values named in the error."""

import pytest

from tasks.config import LLAMA_PROJECTIONS, ConfigError, LoraConfig, TrainConfig
from tasks.config.io import config_from_json_dict, load_config, parse_override, to_dict


def test_off_by_default():
    cfg = TrainConfig()
    assert not cfg.actor.lora.enabled and not cfg.critic.lora.enabled
    assert cfg.actor.lora.target_modules == list(LLAMA_PROJECTIONS)
    assert cfg.rollout.lora_mode == "adapter"


def test_nested_overrides_and_preset():
    cfg = load_config("tiny_ppo", ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.target_modules=[q_proj, v_proj]",
                                   "critic.lora.rank=2", "rollout.lora_mode=merged"])
    assert cfg.actor.lora == LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
    assert cfg.critic.lora.rank == 2 and cfg.rollout.lora_mode == "merged"
    assert config_from_json_dict(to_dict(cfg)) == cfg  # travels as JSON (run.json, Flyte) unchanged
    preset = load_config("tiny_ppo_lora")
    assert preset.actor.lora.enabled
    assert load_config("tiny_ppo_lora", ["actor.lora.rank=0"]).actor.lora.enabled is False


def test_parse_override_keeps_the_path():
    assert parse_override("actor.lora.rank=8") == (["actor", "lora", "rank"], 8)


@pytest.mark.parametrize("overrides, fragment", [
    (["actor.lora.rank=-1"], "actor.lora.rank must be >= 0 (0 = off), got -1"),
    (["actor.lora.rank=8", "actor.lora.alpha=0"], "actor.lora.alpha must be > 0"),
    (["critic.lora.dropout=1.0"], "critic.lora.dropout must be in [0, 1)"),
    (["actor.lora.target_modules=[]"], "actor.lora.target_modules must be a non-empty list"),
    (["actor.lora.bogus=1"], "unknown key(s) in actor.lora: ['bogus']"),
    (["actor.lora.rank=x"], "actor.lora.rank must be an integer"),
    (["actor.lora=5"], "actor.lora must be a mapping, got int"),
    (["actor.lr.x=1"], "actor.lr is a value, not a section"),
    (["rollout.lora_mode=fused"], "rollout.lora_mode='fused' is not one of ['adapter', 'merged']"),
    (["actor.lora.rank=1024"], "vLLM serves adapters up to rank 512; use rollout.lora_mode=merged"),
    (["critic.lora.rank=8", "critic.remote_url=http://127.0.0.1:1"], "critic.lora needs the critic inside the tasks"),
])
def test_bad_values_are_named(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_ppo", overrides)
    assert fragment in str(err.value)


def test_high_rank_is_fine_when_merged():
    assert load_config("tiny_ppo", ["actor.lora.rank=1024", "rollout.lora_mode=merged"]).actor.lora.rank == 1024
