"""The projection of an iteration at scale in both run modes (``benchmarks/project_iteration.py``): its byte
and second formulas by hand at a tiny shape, the 8B and 70B shapes read off the presets they project, the
cut's bytes, the resident mode's storage traffic (batches and checkpoints only)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.project_iteration import (CPU_TASKS, LLAMA_8B, LLAMA_70B, LLAMA_70B_FULL, NEMO_70B, PARTS, PRESETS,
                                         Assumptions, Shape, breakdown, compute_seconds, critic_sharded, gpus_held,
                                         llama_params, main, moved, project, push_seconds, rows, state_bytes)
from models.config.io import load_config

TINY = Shape("tiny", params=1000, samples=2, prompt_tokens=3, response_tokens=5, actor_nodes=2, gpus_per_node=2,
             critic_gpus=2, push_density=1.0)  # full pushes (the delta's case by hand below)


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


def test_state_bytes_by_hand_on_several_scoring_nodes_and_a_sharded_full_critic():
    """Scoring as an elastic task: each of 2 nodes downloads the actor, reference, reward model and critic
    (16000 B) and reads the batch (384 B); one writes the scored batch. A full critic on 2 nodes reads its
    AdamW state (8000 B) once per node whole, once in all when committed per rank."""
    assert state_bytes(replace(TINY, score_nodes=2))["score"] == {"read": 2 * 16384, "write": 384}
    full = replace(TINY, critic_lora=False, critic_gpus=4)
    whole, cut = (state_bytes(replace(full, critic_sharded_state=c))["critic_update"] for c in (False, True))
    assert whole == {"read": 2 * (8000 + 384 + 8000), "write": 12000}
    assert whole["read"] - cut["read"] == 8000 and cut["write"] == 12000
    assert state_bytes(replace(full, critic_sharded_state=True))["actor_update"] == state_bytes(full)["actor_update"]


# Round numbers for the hand-worked cases: storage, NCCL, NVLink and host copies 1000 B/s, 1000 FLOP/s per GPU at
# MFU 1, 5 tokens/s.
SLOW = Assumptions(s3_gb_per_s=1e-6, nccl_gb_per_s=1e-6, nvlink_gb_per_s=1e-6,
                   peak_tflops=1e-9, train_mfu=1.0, forward_mfu=1.0, gen_tokens_per_s_per_gpu=5.0,
                   thin_pod_start_s=2.0)


def test_resident_iteration_by_hand():
    """TINY (1000 parameters, 2 × 8 tokens, actor on 2 × 2 GPUs, LoRA critic on 2, a reward model) with a
    checkpoint every 3 iterations: 5 thin pods × 2 s; batches 6 × 384 B at 1000 B/s; 2 × 5 response tokens at 5
    tokens/s; scoring, π_old, π_ref and the reward model on the actor's 4 GPUs (2·3·1000·16 / 4000 = 24 s) then
    the values on the critic's 2 (2·1000·16 / 2000 = 16 s); updates, the longer of the actor (6·1000·16 / 4000 =
    24 s) and the LoRA critic (4·1000·16 / 2000 = 32 s), the actor's push after it (3.5 s: :func:`push_seconds`)
    still shorter than the critic's, so it adds nothing; the actor's checkpoint (12000 B over 2 nodes: 6 s) every 3."""
    p = breakdown(replace(TINY, save_interval=3), SLOW, "resident")
    assert p == pytest.approx({"pod starts": 10.0, "state movement": 2.304, "weight transfer": 0.0,
                               "generation": 2.0, "scoring": 40.0, "updates": 32.0, "checkpoint": 2.0,
                               "total": 88.304})


def test_the_push_by_hand_and_on_the_critical_path():
    """B = 1000 parameters × 2 B = 2000 B. Gather into rank 0 of 2 × 2 ranks: a quarter is its own, a quarter over
    NVLink (500 B: 0.5 s), half from the other node over its NIC (1000 B: 1 s); the sends 2000 B (2 s: each worker
    of a 2-GPU tensor-parallel engine its 1000-B share, loaded in place). With the critic on 4 GPUs (its update
    16 s, its values 8 s) the actor's update (24 s) and push (3.5 s) are the longer branch: the push adds 3.5 s."""
    tp2 = replace(TINY, save_interval=3, rollout_gpus=2, critic_gpus=4)
    assert push_seconds(tp2, SLOW) == pytest.approx({"gather": 1.5, "broadcast": 2.0, "load": 0.0})
    assert push_seconds(TINY, SLOW)["load"] == 0  # one engine GPU: in place
    # a delta push at density 0.1: 0.1 × (1 + 1) / 2 + 1 / 512 of the bytes (a byte of position and one of step per
    # change in bfloat16), every step that share of the full one's
    share = 0.1 + 1 / 512
    delta = push_seconds(replace(tp2, push_density=0.1), SLOW)
    assert delta == pytest.approx({"gather": 1.5 * share, "broadcast": 2.0 * share, "load": 0.0})
    p = breakdown(tp2, SLOW, "resident")
    assert p == pytest.approx({"pod starts": 10.0, "state movement": 2.688, "weight transfer": 3.5,
                               "generation": 1.0, "scoring": 32.0, "updates": 24.0, "checkpoint": 2.0,
                               "total": 75.188})
    assert gpus_held(tp2, SLOW, "resident") == (2 + 4 + 4) * p["total"]  # engine, actor (reward model too), critic


def test_the_resident_mode_moves_no_state_between_checkpoints():
    """TINY by hand: batches 2304 B and the actor's 12000-byte checkpoint every 3 iterations; stateless, the
    weights and moments of :func:`test_state_bytes_by_hand` (76000 B) every iteration, nothing over NCCL."""
    tiny = replace(TINY, save_interval=3)
    assert moved(tiny, "resident") == {"storage": 2304 + 4000, "state": 0.0, "checkpoint": 4000.0, "in memory": 2000}
    assert moved(tiny, "stateless") == {"storage": 76000 + 2304, "state": 76000, "checkpoint": 0.0, "in memory": 0.0}
    for s in PRESETS:
        resident, stateless = moved(s, "resident"), moved(s, "stateless")
        assert resident["state"] == 0 and resident["storage"] < stateless["state"] / 100, s.name
        assert breakdown(s, Assumptions(), "resident")["state movement"] < 1.0, s.name


def test_stateless_breakdown_is_the_gpu_chain_plus_the_cpu_pods_and_the_engine_start():
    a = Assumptions()
    for s in (*PRESETS, NEMO_70B):
        p, it = breakdown(s, a, "stateless"), project(s, a)["iteration"]
        assert p["total"] == pytest.approx(it["total"] + a.engine_start_s + len(CPU_TASKS) * a.cpu_pod_start_s)
        assert p["total"] == pytest.approx(sum(p[k] for k in PARTS))
        assert p["weight transfer"] == p["checkpoint"] == 0 and p["state movement"] == it["state"]
        assert breakdown(s, a, "resident")["total"] < p["total"], s.name


def test_each_projected_preset_is_its_config():
    """``PRESETS`` as their YAML files set them: batch, topologies, critic, AdamW per rank, checkpoints; the 70B
    presets score as an elastic task on the actor's topology, the 8B ones on ``resources.score_gpu``."""
    assert [s.name for s in PRESETS] == ["llama8b_ppo_gpu", "llama8b_ppo_full_critic_gpu", "llama70b_ppo_gpu",
                                         "llama70b_ppo_full_critic_gpu"]
    for s in PRESETS:
        cfg = load_config(f"configs/{s.name}.yaml", [])
        assert s.samples == cfg.rollout.prompts_per_iteration * cfg.rollout.n_samples_per_prompt, s.name
        assert (s.response_tokens, s.save_interval) == (cfg.rollout.max_new_tokens, cfg.run.save_interval), s.name
        assert (s.actor_nodes, s.gpus_per_node) == (cfg.actor.nnodes, cfg.actor.nproc_per_node), s.name
        assert s.rollout_gpus == cfg.resources.rollout_gpu == cfg.rollout.tensor_parallel_size, s.name
        assert s.critic_gpus == cfg.critic.nnodes * cfg.critic.nproc_per_node, s.name
        assert s.critic_lora == cfg.critic.lora.enabled and s.sharded_state == cfg.actor.optimizer_state_sharded
        assert s.critic_lora or critic_sharded(s) == cfg.critic.optimizer_state_sharded, s.name
        assert s.score_gpus == cfg.resources.score_gpu, s.name
        big = s.params > 50e9
        assert (s.score_nodes, s.score_gpus) == ((cfg.actor.nnodes, cfg.actor.nproc_per_node) if big else (1, 1))
    assert LLAMA_70B_FULL.critic_params is None and "70b" in load_config(
        "configs/llama70b_ppo_full_critic_gpu.yaml", []).model.critic_path



def test_the_grpo_preset_projected_beside_nemo_rl_is_its_config():
    """The 8B GRPO shape the layouts compare with NeMo-RL's GRPO step is ``configs/llama8b_grpo_gpu.yaml``: its
    batch, budget, topology, no critic and no reward model, resident and colocated."""
    from benchmarks.projection_inputs import LLAMA_8B_GRPO as s

    cfg = load_config(f"configs/{s.name}.yaml", [])
    assert s.samples == cfg.rollout.prompts_per_iteration * cfg.rollout.n_samples_per_prompt == 512
    assert (s.response_tokens, s.save_interval) == (cfg.rollout.max_new_tokens, cfg.run.save_interval)
    assert (s.actor_nodes, s.gpus_per_node, s.params) == (cfg.actor.nnodes, cfg.actor.nproc_per_node, LLAMA_8B.params)
    assert not cfg.uses_critic and s.critic_gpus == 0 and s.critic_params == 0
    assert cfg.reward.source == "function" and not s.reward_model
    assert cfg.run.resident and cfg.run.resident_layout == "colocated"

def test_rows_set_both_modes_beside_both_peers():
    out = {r.figure: r for r in rows(Assumptions())}
    for mode in ("stateless", "resident"):
        assert "253.8 s published" in out[f"70B full critic {mode} / NeMo-Aligner step"].detail
        assert "92.8 s" in out[f"8B {mode} / NeMo-RL, s per 1M tokens"].detail
        for s in PRESETS:
            want = breakdown(s, Assumptions(), mode)["total"]
            assert out[f"{s.name} s/iteration ({mode})"].value == pytest.approx(want)


def test_mode_flag_prints_the_modes_asked_for(capsys):
    assert main(["--mode", "resident"]) == 0
    printed = capsys.readouterr().out
    assert "resident" in printed and "stateless" not in printed
    with pytest.raises(ValueError, match="mode 'both': expected one of stateless, resident"):
        breakdown(LLAMA_8B, Assumptions(), "both")
    with pytest.raises(SystemExit):
        main(["--mode", "colocated"])
    assert "invalid choice: 'colocated'" in capsys.readouterr().err
