"""LoRA settings: off by default, nested ``actor.lora.*`` overrides, bad values named in the error."""

import pytest

from models.config import ConfigError, LoraConfig, TrainConfig
from models.config.io import config_from_json_dict, load_config, parse_override, to_dict


def test_by_default_every_weight_trains_and_a_rank_alone_adapts_every_projection(tmp_path):
    """The default config trains the whole actor; ``actor.lora.rank`` alone puts adapters on every
    linear layer of the decoder (all a Llama has besides the head) and trains only them."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.checkpoint import save_checkpoint
    from models.training.lora import CAUSAL_LM, is_peft
    from models.demos.tiny import TinyModelConfig, build_actor, save_model
    from models.demos.tokenizer import build_char_tokenizer
    from models.stages.updates import load_trainable

    tok = build_char_tokenizer()
    url = str(tmp_path / "actor")
    save_checkpoint(str(save_model(build_actor(TinyModelConfig(), tok), tok, tmp_path / "hf")), url)
    full = load_trainable(url, AutoModelForCausalLM, "float32", TrainConfig().actor.lora, CAUSAL_LM)
    assert not is_peft(full) and all(p.requires_grad for p in full.parameters())
    linears = {n.rsplit(".", 1)[-1] for n, m in full.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    adapted = load_trainable(url, AutoModelForCausalLM, "float32",
                             load_config("tiny_ppo", ["actor.lora.rank=4"]).actor.lora, CAUSAL_LM)
    trained = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained} == linears


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
