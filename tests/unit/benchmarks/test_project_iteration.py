"""The projection of a stateless iteration at scale (``benchmarks/project_iteration.py``): its byte
formula by hand at a tiny shape, the 8B shape read off the preset it projects, the cut's bytes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.project_iteration import LLAMA_8B, LLAMA_70B, Assumptions, Shape, project, rows, state_bytes
from tasks.config.io import load_config

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
    p = project(LLAMA_70B, a)
    upd = max(p["actor_update"]["total"], p["critic_update"]["total"])
    assert p["iteration"]["total"] == pytest.approx(p["rollout"]["total"] + p["score"]["total"] + upd)
    assert project(replace(LLAMA_70B, sharded_state=True), a)["iteration"]["state"] < p["iteration"]["state"]


def test_the_8b_shape_is_the_preset():
    cfg = load_config("configs/llama8b_ppo_gpu.yaml", [])
    assert LLAMA_8B.samples == cfg.rollout.prompts_per_iteration * cfg.rollout.n_samples_per_prompt
    assert LLAMA_8B.response_tokens == cfg.rollout.max_new_tokens
    assert LLAMA_8B.actor_nodes == cfg.actor.nnodes and LLAMA_8B.gpus_per_node == cfg.actor.nproc_per_node
    assert LLAMA_8B.critic_lora == cfg.critic.lora.enabled
    assert (LLAMA_8B.rollout_gpus, LLAMA_8B.score_gpus, LLAMA_8B.critic_gpus) == (
        cfg.resources.rollout_gpu, cfg.resources.score_gpu, cfg.resources.critic_gpu)


def test_rows_compare_with_the_published_nemo_aligner_step():
    out = {r.figure: r for r in rows(Assumptions())}
    ratio = out["70B compute terms / NeMo-Aligner step"]
    assert "253.8 s published" in ratio.detail and ratio.value > 0
