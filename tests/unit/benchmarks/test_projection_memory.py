"""The update's GPU memory on paper (``benchmarks/projection_memory.py``): its terms by hand at a tiny shape, and every
GPU preset held to its GPU as its YAML sets it (micro-batches, lengths, activation checkpointing): each fits, and
the 70B preset with the actor's checkpointing off does not."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.projection_inputs import (LLAMA3_8B_DIMS, LLAMA3_70B_DIMS, LLAMA_8B_GRPO, PRESETS, Dims, Shape,
                                          llama_params)
from benchmarks.projection_memory import (activation_bytes, layer_activation_bytes, memory_line, misfits,
                                          trainer_memory, update_memory_gb)
from models.config.io import load_config

TINY_DIMS = Dims(layers=2, d_model=8, heads=2, kv_heads=1, ffn=16, vocab=32)
TINY = Shape("tiny", params=1000, samples=2, prompt_tokens=3, response_tokens=5, actor_nodes=2, gpus_per_node=2,
             critic_gpus=1, dims=TINY_DIMS, max_prompt_tokens=3, micro_batch=3, critic_micro_batch=1,
             critic_lora_rank=2)


def test_activations_by_hand():
    """A layer: 8h + 2·h_kv + 4f = 64 + 8 + 64 = 136 elements a token at 2 bytes, plus 4 bytes × 2 heads: 280 bytes.
    10 tokens, off: 2 layers × 280 + the head's 4h × 2 = 64, 624 bytes a token; on: each layer's input (2 × 16) and one
    layer recomputed (280), 376 a token."""
    assert layer_activation_bytes(TINY_DIMS) == 280
    assert activation_bytes(TINY_DIMS, 10, checkpointed=False) == 6240
    assert activation_bytes(TINY_DIMS, 10, checkpointed=True) == 3760


def test_a_trainers_memory_by_hand():
    """The actor on 4 ranks: 16 × 1000 / 4 = 4000 B of state; π_ref and the reward model 2 × 4000 / 4 = 2000 B; a
    layer (2·64 + 2·8·4 + 3·8·16 + 2·8 = 592 parameters) gathered at 2·2 + 4 bytes: 4736 B; 3 rows of 3 + 5 tokens,
    checkpointed, 24 × 376 = 9024 B. The LoRA critic on one GPU: its base at 2 bytes (2000 B) and 16 B for each of
    its 2 × 2 × (2·16 + 2·12 + 3·24) = 512 adapter parameters; nothing gathered; 8 tokens, off: 8 × 624 = 4992 B."""
    assert trainer_memory(TINY, "actor") == {"state": 4000, "frozen": 2000, "gathered": 4736, "activations": 9024}
    critic = trainer_memory(replace(TINY, critic_activation_checkpointing=False), "critic")
    assert critic == {"state": 2000 + 16 * 512, "frozen": 0, "gathered": 0, "activations": 4992}
    assert trainer_memory(replace(TINY, critic_gpus=0), "critic") is None
    assert update_memory_gb(TINY)["actor"]["total"] == pytest.approx((4000 + 2000 + 4736 + 9024) / 1e9)


def test_the_dims_are_the_projected_parameters():
    d = LLAMA3_70B_DIMS
    assert llama_params(d.layers, d.d_model, d.kv_heads, d.ffn, d.vocab, heads=d.heads, tied=False) == PRESETS[2].params
    d = LLAMA3_8B_DIMS
    assert llama_params(d.layers, d.d_model, d.kv_heads, d.ffn, d.vocab, heads=d.heads, tied=False) == pytest.approx(
        PRESETS[0].params, rel=1e-3)


def as_configured(s: Shape, cfg) -> Shape:
    """``s`` with what its preset's YAML sets for the update's memory."""
    a = cfg.actor
    out = replace(s, micro_batch=a.micro_batch_size, activation_checkpointing=a.activation_checkpointing,
                  max_prompt_tokens=cfg.data.max_prompt_tokens, response_tokens=cfg.rollout.max_new_tokens)
    if not cfg.uses_critic:
        return out
    c = cfg.critic
    return replace(out, critic_micro_batch=c.micro_batch_size,
                   critic_activation_checkpointing=c.activation_checkpointing,
                   critic_lora_rank=c.lora.rank if c.lora.enabled else s.critic_lora_rank)


@pytest.mark.parametrize("s", [*PRESETS, LLAMA_8B_GRPO], ids=lambda s: s.name)
def test_every_gpu_preset_s_update_fits_its_gpu(s):
    cfg = load_config(f"configs/{s.name}.yaml", [])
    assert misfits(as_configured(s, cfg)) == {} and cfg.resources.accelerator == "nvidia-h100"
    assert as_configured(s, cfg) == s  # the projection's shape is the preset
    assert set(update_memory_gb(s)) == ({"actor", "critic"} if cfg.uses_critic else {"actor"})


def test_a_70b_preset_without_activation_checkpointing_does_not_fit():
    """Off, the 70B actor's micro-batch of 2 × 2,048 tokens keeps 80 layers × 364,800 B a token: ~120 GB."""
    cfg = load_config("configs/llama70b_ppo_gpu.yaml", ["actor.activation_checkpointing=false"])
    bad = misfits(as_configured(PRESETS[2], cfg))
    assert set(bad) == {"actor"} and "actor.activation_checkpointing=false" in bad["actor"]
    assert update_memory_gb(as_configured(PRESETS[2], cfg))["actor"]["activations"] == pytest.approx(
        (80 * 364_800 + 4 * 2 * 8192) * 4096 / 1e9)
    cfg = load_config("configs/llama8b_ppo_gpu.yaml", ["critic.activation_checkpointing=false"])
    assert set(misfits(as_configured(PRESETS[0], cfg))) == {"critic"}  # 8 rows × 2,048 tokens on one GPU
    assert "critic" in memory_line(PRESETS[0]) and "actor" in memory_line(PRESETS[0])
