"""The resident layouts on paper (``benchmarks/projection_layouts.py``): the colocated and async iterations, the
in-process load, the GPUs each layout holds and the recommended default, by hand at a tiny shape; the printed
table's columns; the bars of issue #39 and the peers' published figures as rows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.project_iteration import main
from benchmarks.projection_inputs import NEMO_RL_8B_TOKENS, PRESETS, Assumptions, Shape
from benchmarks.projection_layouts import (LAYOUTS, async_breakdown, balanced_async, colocated_breakdown,
                                           colocated_memory_gb, inprocess_load_seconds, layout_breakdown, layout_gpus,
                                           layout_rows, recommend, tokens_per_s_per_gpu)

# 1000 parameters, 2 × (3 + 5) tokens, the actor on 2 nodes × 2 GPUs, a tensor-parallel-2 engine, a LoRA critic on 4
# GPUs, a checkpoint every 3 iterations (test_project_iteration.py's push case).
TP2 = Shape("tiny", params=1000, samples=2, prompt_tokens=3, response_tokens=5, actor_nodes=2, gpus_per_node=2,
            critic_gpus=4, rollout_gpus=2, save_interval=3, push_density=1.0)  # full pushes
# Round numbers: every link and HBM 1000 B/s, 1000 FLOP/s per GPU at MFU 1, 5 tokens/s per GPU, thin pods 2 s,
# sleep 1 s, wake 2 s.
SLOW = Assumptions(s3_gb_per_s=1e-6, nccl_gb_per_s=1e-6, nvlink_gb_per_s=1e-6,
                   hbm_gb_per_s=1e-6, peak_tflops=1e-9, train_mfu=1.0, forward_mfu=1.0, gen_tokens_per_s_per_gpu=5.0,
                   thin_pod_start_s=2.0, engine_sleep_s=1.0, engine_wake_s=2.0)
# The separate resident iteration of TP2 under SLOW, by hand in test_project_iteration.py: 5 pods × 2 s, batches
# 2.688 s, push 3.5 s (gather 1.5, sends 2, loaded in place), generation 1 s, scoring 32 s, updates 24 s (the actor's;
# the critic's 16 s), checkpoint 2 s.
TRAINER_SIDE = 10 + 2.688 + 32 + 24 + 2


def test_inprocess_load_by_hand():
    """B = 2000 B. Gather: each rank receives the other node's half (1000 B over its NIC, 1 s) and its node's other
    quarter (500 B over NVLink, 0.5 s); copy: its half (tensor parallel 2) read and written, 2 × 1000 B in HBM, 2 s.
    A one-GPU engine copies the whole model: 4 s."""
    assert inprocess_load_seconds(TP2, SLOW) == pytest.approx({"gather": 1.5, "copy": 2.0})
    assert inprocess_load_seconds(replace(TP2, rollout_gpus=1), SLOW)["copy"] == pytest.approx(4.0)


def test_colocated_iteration_by_hand():
    """Generation on the actor's 4 GPUs: 10 tokens / (5 × 4) = 0.5 s. After the actor's 24-s update, the wake (2 s)
    and the load (3.5 s) outlast the critic's 16 s: 5.5 s on the path, the wake's 2 counted with the sleep (1 s)
    before scoring; no push, no engine GPU."""
    p = colocated_breakdown(TP2, SLOW)
    assert p == pytest.approx({"pod starts": 10.0, "state movement": 2.688, "weight transfer": 3.5, "generation": 0.5,
                               "scoring": 32.0, "updates": 24.0, "checkpoint": 2.0, "sleep and wake": 3.0,
                               "overlap": 0.0, "total": 77.688})
    assert (layout_gpus(TP2, "colocated"), layout_gpus(TP2, "separate")) == (8, 10)
    # a critic update of 32 s (on 2 GPUs) hides the actor's 24 + 2 + 3.5 s: only the sleep is left
    hidden = colocated_breakdown(replace(TP2, critic_gpus=2), SLOW)
    assert (hidden["weight transfer"], hidden["sleep and wake"]) == (0.0, 1.0)


def test_colocated_memory_by_hand():
    """Per GPU of 4: (1000 × (4 + 8) + 2 × 1000 × 4) / 4 = 5000 B of trainer state (π_ref and the reward model
    float32), 2000 / 2 = 1000 B of engine weights; without a reward model, 4000 B."""
    assert colocated_memory_gb(TP2) == pytest.approx({"trainer": 5000 / 1e9, "engine": 1000 / 1e9})
    assert colocated_memory_gb(replace(TP2, reward_model=False))["trainer"] == pytest.approx(4000 / 1e9)


def test_async_iteration_is_the_longer_side_plus_the_push():
    """k >= 1: max(generation 1 s, trainer side 70.688 s) + the push 3.5 s; generation-bound at 0.01 tokens/s per
    GPU: 10 / (0.01 × 2) = 500 s + 3.5 s."""
    p = async_breakdown(TP2, SLOW)
    assert p["total"] == pytest.approx(TRAINER_SIDE + 3.5) and p["overlap"] == pytest.approx(-1.0)
    assert p["weight transfer"] == pytest.approx(3.5) and p["sleep and wake"] == 0
    slow_gen = replace(SLOW, gen_tokens_per_s_per_gpu=0.01)
    assert async_breakdown(TP2, slow_gen)["total"] == pytest.approx(500 + 3.5)
    # sized to the trainer's side: 4 engine GPUs (the actor's count, the most it may take) still generate 250 s, and
    # their push is the same 3.5 s (the four shares add up to the 2000 B)
    assert balanced_async(TP2, slow_gen) == (4, pytest.approx(250 + 3.5))
    assert balanced_async(TP2, SLOW) == (2, pytest.approx(TRAINER_SIDE + 3.5))


def test_recommendation_is_the_fewest_gpu_hours_on_policy():
    """Colocated 77.688 s × 8 GPUs against separate 75.188 s × 10; a 1000-s sleep makes separate the default."""
    assert layout_breakdown(TP2, SLOW, "separate")["total"] == pytest.approx(75.188)
    assert recommend(TP2, SLOW) == "colocated"
    assert recommend(TP2, replace(SLOW, engine_sleep_s=1000.0)) == "separate"
    assert tokens_per_s_per_gpu(TP2, 77.688, 8) == pytest.approx(16 / (77.688 * 8))
    with pytest.raises(ValueError, match="layout 'hybrid': expected one of separate, colocated, async"):
        layout_breakdown(TP2, SLOW, "hybrid")


def test_rows_carry_the_bars_and_the_published_peers():
    out = {r.figure: r for r in layout_rows(Assumptions())}
    big = out["llama70b_ppo_full_critic_gpu colocated s/iteration"]
    assert big.target == "<= 200" and "NeMo-Aligner 253.8 s" in big.detail
    peer = NEMO_RL_8B_TOKENS / (92.8 * 16)
    for s, gpus in zip(PRESETS[:2], (8 + 1, 8 + 8)):  # the actor's 8 and the LoRA critic's 1 or the full one's 8
        r, t = out[f"NeMo-RL tokens/s/GPU / {s.name} colocated"], layout_breakdown(s, Assumptions(), "colocated")
        assert r.target == "<= 1.5" and r.value == pytest.approx(peer / (512 * 1536 / (t["total"] * gpus)))
    assert out["NeMo-RL 8B one-step-off / on-policy (published)"].value == pytest.approx(74.6 / 97.7)
    assert out["veRL fully async / colocated sync (published)"].value == pytest.approx(150.63 / 356.30)
    assert out["NeMo-RL 32B one-step-off / on-policy tokens/s/GPU (published)"].value == pytest.approx(494 / 540)
    for s in PRESETS:
        assert out[f"{s.name} s/iteration (async)"].value == pytest.approx(
            layout_breakdown(s, Assumptions(), "async")["total"])


def test_the_printed_table_has_each_layout_and_the_recommendation(capsys):
    assert main(["--mode", "resident"]) == 0
    printed = capsys.readouterr().out
    header = next(ln for ln in printed.splitlines() if ln.strip().startswith("seconds per iteration") and
                  "colocated" in ln)
    assert header.split()[-3:] == list(LAYOUTS)
    for label in ("sleep and wake", "tokens/s/GPU", "GPU·h per iteration", "recommended default: colocated",
                  "0 bytes between processes", "async with the engine sized", "colocated GPU memory"):
        assert label in printed, label
    assert printed.count("recommended default:") == len(PRESETS) + 1  # and the GRPO shape
    lines = printed.splitlines()
    top = lines.index("resident layouts: s/iteration (GPUs) and the recommended default")
    assert lines[top + 1].split() == ["preset", *LAYOUTS, "recommended"]
    for s, summary in zip(PRESETS, lines[top + 2:]):
        t = layout_breakdown(s, Assumptions(), "colocated")["total"]
        assert summary.split()[0] == s.name and summary.split()[-1] == recommend(s, Assumptions()) == "colocated"
        assert f"{t:.0f} ({layout_gpus(s, 'colocated')})" in summary


def test_every_gpu_preset_runs_resident_in_the_layout_the_projection_recommends_and_fits_it():
    """The preset's ``run.resident_layout`` is the projection's default (the 70B presets: engine groups of 8 ranks),
    it loads resident, and colocated vLLM's share of an 80-GB GPU fits beside what the trainer keeps there (vLLM
    refuses to start with less free memory than its share) and holds the engine's weights."""
    from models.config.io import load_config

    from benchmarks.projection_inputs import LLAMA_8B_GRPO

    for s in (*PRESETS, LLAMA_8B_GRPO):
        cfg = load_config(f"configs/{s.name}.yaml", ["run.resident=true"])
        assert cfg.run.resident_layout == recommend(s, Assumptions()), s.name
        if cfg.run.resident_layout == "colocated":
            mem, share = colocated_memory_gb(s), cfg.rollout.vllm_gpu_memory_utilization * 80
            assert mem["trainer"] + share <= 80 and share > mem["engine"], (s.name, mem, share)
            ranks = cfg.actor.nnodes * cfg.actor.nproc_per_node
            assert ranks % cfg.rollout.tensor_parallel_size == 0 and s.rollout_gpus == cfg.rollout.tensor_parallel_size
