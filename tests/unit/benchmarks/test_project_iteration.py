"""The projection of a stateless iteration at scale (``benchmarks/project_iteration.py``): its byte
formula by hand at a tiny shape, the 8B and 70B shapes read off the presets they project, the cut's bytes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.project_iteration import (LLAMA_8B, LLAMA_70B, NEMO_70B, Assumptions, Shape, compute_seconds,
                                         llama_params, project, rows, state_bytes)
from models.config.io import load_config

TINY = Shape("tiny", params=1000, samples=2, prompt_tokens=3, response_tokens=5, actor_nodes=2, gpus_per_node=2,
             critic_gpus=2)


def test_state_bytes_by_hand():
    """W = 4000 B, O = 8000 B, batch = 2 × 8 tokens × 24 B = 384 B; two actor nodes each read the actor,
    the reference and the whole AdamW state; rank 0 writes W + O; the LoRA critic writes no full state."""
    b = state_bytes(TINY)
    assert b["rollout"] == {"read": 8000, "write": 384}
    assert b["score"] == {"read": 16384, "write": 384}
    assert b["actor_update"] == {"read": 2 * (8000 + 384 + 8000), "write": 12000}
    assert b["critic_update"] == {"read": 8384, "write": 0}
    # the cut: each node reads its half of O, so O is read once in all (2 × 8000 → 8000 bytes)
    cut = state_bytes(replace(TINY, sharded_state=True))["actor_update"]
    assert b["actor_update"]["read"] - cut["read"] == 8000 and cut["write"] == 12000


def test_the_iteration_is_the_chain_and_the_longer_update():
    a = Assumptions()
    for shape in (LLAMA_70B, NEMO_70B):
        p = project(shape, a)
        upd = max(p["actor_update"]["total"], p["critic_update"]["total"])
        assert p["iteration"]["total"] == pytest.approx(p["rollout"]["total"] + p["score"]["total"] + upd)
        assert project(replace(shape, sharded_state=True), a)["iteration"]["state"] < p["iteration"]["state"]


def test_the_8b_shape_is_the_preset():
    cfg = load_config("configs/llama8b_ppo_gpu.yaml", [])
    assert LLAMA_8B.samples == cfg.rollout.prompts_per_iteration * cfg.rollout.n_samples_per_prompt
    assert LLAMA_8B.response_tokens == cfg.rollout.max_new_tokens
    assert LLAMA_8B.actor_nodes == cfg.actor.nnodes and LLAMA_8B.gpus_per_node == cfg.actor.nproc_per_node
    assert LLAMA_8B.critic_lora == cfg.critic.lora.enabled
    assert (LLAMA_8B.rollout_gpus, LLAMA_8B.score_gpus, LLAMA_8B.critic_gpus) == (
        cfg.resources.rollout_gpu, cfg.resources.score_gpu, cfg.resources.critic_gpu)


def test_llama_parameter_counts():
    """Meta's published counts: Llama-3-8B 8,030,261,248 parameters; Llama-3-70B by hand: per layer q, o
    2·8192² = 134,217,728, k, v 2·8192·1024 = 16,777,216, MLP 3·8192·28672 = 704,643,072, norms 16,384
    (855,654,400 × 80 = 68,452,352,000), embedding and head 2·128256·8192 = 2,101,346,304, final norm 8192."""
    assert llama_params(32, 4096, 8, 14336, 128256, heads=32, tied=False) == 8_030_261_248
    assert llama_params(80, 8192, 8, 28672, 128256, heads=64, tied=False) == 70_553_706_496 == LLAMA_70B.params


def test_the_70b_shape_is_the_preset():
    """The preset loads and validates without loading any model, and the projection reads its sizes."""
    cfg = load_config("configs/llama70b_ppo_gpu.yaml", [])
    assert LLAMA_70B.samples == cfg.rollout.prompts_per_iteration * cfg.rollout.n_samples_per_prompt == 1024
    assert LLAMA_70B.response_tokens == cfg.rollout.max_new_tokens
    assert (LLAMA_70B.actor_nodes, LLAMA_70B.gpus_per_node) == (cfg.actor.nnodes, cfg.actor.nproc_per_node) == (8, 8)
    assert (cfg.actor.sharding, cfg.model.dtype, cfg.actor.lora.enabled) == ("fsdp2", "bfloat16", False)
    assert cfg.actor.optimizer_state_sharded and cfg.resources.accelerator == "nvidia-h100"
    assert LLAMA_70B.critic_lora == cfg.critic.lora.enabled and "8b" in cfg.model.critic_path
    assert (LLAMA_70B.rollout_gpus, LLAMA_70B.score_gpus, LLAMA_70B.critic_gpus) == (
        cfg.resources.rollout_gpu, cfg.resources.score_gpu, cfg.resources.critic_gpu)
    assert cfg.resources.actor_gpu == cfg.actor.nproc_per_node


def test_scoring_forwards_count_each_model_at_its_size():
    """2·P·tokens FLOPs a forward: the 70B preset scores π_old, π_ref and the reward model at 70.6B and its
    critic at 8B, 1024 × 1536 tokens on 8 GPUs at 0.45 × 989 TFLOP/s."""
    a = Assumptions()
    by_hand = 2 * (3 * LLAMA_70B.params + LLAMA_8B.params) * 1024 * 1536 / (8 * 989e12 * 0.45)
    assert compute_seconds(LLAMA_70B, a)["score"] == pytest.approx(by_hand)


def test_rows_compare_with_the_published_nemo_aligner_step():
    out = {r.figure: r for r in rows(Assumptions())}
    ratio = out["70B compute terms / NeMo-Aligner step"]
    assert "253.8 s published" in ratio.detail and ratio.value > 0
